"""``data.packing: documents``: whole examples packed into sequences, each attending only to itself.

``packing: true`` concatenates the examples and cuts the stream every ``max_seq_len`` tokens: no
padding, but an example is cut across two sequences (a completion's second half trained without its
prompt in view) and attends to the unrelated ones before it. ``documents`` instead:

* places every example whole (truncated to ``max_seq_len`` where longer, as without packing) into
  sequences by best fit, longest first (:func:`best_fit`): nearly as few sequences as the tokens
  need, never one example split;
* gives each example position ids from 0 (``_positions.npy`` beside the ids) and no attention mask,
  which Hugging Face's models (those that build their attention masks with transformers'
  ``masking_utils``) read as separate documents: a token attends to its own example only, so each
  example's logits are those it has alone (up to rounding);
* makes no token the target of the one before its example (its first token: in a sequence of its
  own that token is never a target either).

A model that builds its masks otherwise (OPT, Bloom: from the attention mask; a state-space model,
Mamba, RWKV: its state runs on from one example into the next) would train each example on the ones
before it, silently: :func:`documents_seen` watches the first step's forwards for the mask
transformers builds from the position ids, and refuses the run before that step is taken.
"""

from __future__ import annotations

import bisect
import contextlib
import logging

import numpy as np

from offload_core.errors import ConfigError

log = logging.getLogger("tiered_offload")

__all__ = ["DOCUMENTS", "best_fit", "write_documents", "documents_seen"]

DOCUMENTS = "documents"
"""The ``data.packing`` value that packs whole examples as separate documents."""


def best_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """The sequence each example goes to (an array as long as ``lengths``, each at most
    ``capacity``): best-fit decreasing, the longest example first, each into the sequence with the
    least room left that holds it (a new one where none does); ties by position, so the result is
    the same for the same lengths. The open sequences are kept by their room left (at most
    ``capacity + 1`` values), so a million examples take seconds, and 8 bytes each."""
    where = np.empty(len(lengths), dtype=np.int64)
    rooms: list[int] = []  # the room left values some open sequence has, sorted
    open_: dict[int, list[int]] = {}  # room left -> the sequences with it
    count = 0
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        k = bisect.bisect_left(rooms, n)
        if k == len(rooms):
            seq, room = count, capacity - n
            count += 1
        else:
            room = rooms[k]
            seq = open_[room].pop()
            if not open_[room]:
                del open_[room]
                rooms.pop(k)
            room -= n
        where[i] = seq
        if room > 0:
            if room not in open_:
                bisect.insort(rooms, room)
                open_[room] = []
            open_[room].append(seq)
    return where


def write_documents(spool, examples: np.ndarray, length: int, pad: int, output, ignore: int) -> int:
    """The examples ``examples`` (their indices in ``spool``, in the data's order) packed as
    documents into ``length``-token sequences: ``_ids``, ``_labels`` and ``_positions`` arrays made
    by ``output(name, dtype, fill, n)``; returns the number of sequences."""
    lengths = np.minimum(np.asarray(spool.lengths[examples]), length)
    where = best_fit(lengths, length)
    n = int(where.max()) + 1 if len(where) else 0
    ids, labels, positions = (output("ids", np.int32, pad, n), output("labels", np.int32, ignore, n),
                              output("positions", np.int32, 0, n))
    if not n:
        return 0
    used = np.zeros(n, dtype=np.int64)
    for i in np.argsort(where, kind="stable"):  # each sequence's examples in the data's order
        row, k = int(where[i]), int(lengths[i])
        s, p = int(spool.offsets[examples[i]]), int(used[row])
        t, m = spool.ids[s:s + k], spool.mask[s:s + k]
        ids[row, p:p + k] = t
        target = np.where(m == 1, t, ignore)
        target[:1] = ignore
        labels[row, p:p + k] = target
        positions[row, p:p + k] = np.arange(k)
        used[row] += k
    for row in np.flatnonzero(used < length):  # the padding: a stretch of its own
        positions[row, used[row]:] = np.arange(length - used[row])
    truncated = int((np.asarray(spool.lengths[examples]) > length).sum())
    if truncated:
        log.info("%d of %d examples are longer than data.max_seq_len %d: truncated to it", truncated, len(examples),
                 length)
    log.info("packed %d examples whole into %d sequences of %d tokens (%.1f%% padding)", len(examples), n, length,
             100 * (1 - used.sum() / (n * length)))
    for arr in (ids, labels, positions):
        arr.flush()
    return n


@contextlib.contextmanager
def documents_seen(model):
    """Around a forward of batches with restarting position ids: raises :class:`ConfigError` after
    it where the model built no attention mask from them (transformers' ``masking_utils`` never
    looked for packed sequences), naming the model; a forward that refuses the position ids is
    refused the same way."""
    import transformers
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    found = getattr(masking_utils, "find_packed_sequence_indices", None)
    if found is None:  # (transformers before its masking utilities read packed sequences)
        raise ConfigError(f"data.packing: documents needs transformers whose masking utilities read packed sequences "
                          f"from the position ids (find_packed_sequence_indices), and {transformers.__version__} has "
                          f"none: upgrade transformers, or use data.packing true or false")
    calls = []

    def watched(position_ids):
        calls.append(True)
        return found(position_ids)

    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__  # (PEFT's: the model)
    fix = ("; its examples would attend to (or carry state from) the ones before them. Use data.packing: true or "
           "false")
    masking_utils.find_packed_sequence_indices = watched
    try:
        yield
    except TypeError as e:
        if "position_ids" in str(e):
            raise ConfigError(f"data.packing: documents passes position ids, and {name}'s forward refuses them "
                              f"({e}){fix}") from None
        raise
    finally:
        masking_utils.find_packed_sequence_indices = found
    if not calls:
        raise ConfigError(f"data.packing: documents needs a model whose forward builds its attention mask from the "
                          f"position ids (transformers' masking utilities), and {name}'s does not{fix}")
