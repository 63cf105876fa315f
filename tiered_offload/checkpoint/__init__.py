"""Durable training state: the storage directory is the checkpoint. The lock, manifest, journal and
commit protocol (:mod:`.durable`), offline access without the model (:mod:`.state_dir`), and
safetensors import and export (:mod:`.safetensors_io`)."""
