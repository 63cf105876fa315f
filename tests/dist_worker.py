"""One rank of a sharded training run, launched as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment): ``python tests/dist_worker.py OUT CONFIG_JSON``.

Trains the model of :func:`build` on this rank's micro-batches (:func:`batch`) and saves, from
every rank, its losses, its share of the stored state and (rank 0) the final weights to
``OUT/rank-R.pt``. ``tests/test_distributed.py`` compares them with one process training on all
the ranks' batches.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from offload_core.errors import ClipTornError
from tiered_offload_examples.models import GPT, GPTConfig

VOCAB, CONTEXT = 64, 16


def build(cfg: dict):
    if cfg.get("model") == "moe":  # top-1 mixture of experts (tests/test_finetune.py's), see batch()
        from test_finetune import make_moe
        return make_moe()
    if cfg.get("model") == "bare":  # every parameter in a block (the engine's rest unit empty)
        from test_finetune import make_blocks_only
        return make_blocks_only()
    if cfg.get("model") == "mixtral":  # PEFT's LoRA all-linear: on the router and the experts too (ParamWrapper)
        from test_finetune import _peft_mixtral
        return _peft_mixtral()
    if cfg.get("model") == "llama":  # a Hugging Face model (its config recorded), PEFT's LoRA on q and v
        import peft
        import transformers
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=cfg["layers"],
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
            tie_word_embeddings=bool(cfg.get("tied")), use_cache=False))
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                          init_lora_weights=False,
                                                          modules_to_save=cfg.get("modules_to_save")))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, context=CONTEXT, d_model=32, n_layers=cfg["layers"], n_heads=4,
                          dropout=cfg.get("dropout", 0.0)))
    if cfg.get("frozen"):
        for p in model.blocks[1].parameters():  # a frozen block
            p.requires_grad_(False)
    if cfg.get("frozen_below"):  # the embeddings and the lower blocks frozen at build (fine-tuning the top)
        for mod in [model.tok, model.pos, *model.blocks[:cfg["frozen_below"]]]:
            mod.requires_grad_(False)
    if cfg.get("lora"):  # PEFT's LoRA on the blocks' qkv and fc (its adapter initialised at random)
        import peft
        torch.manual_seed(1)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["qkv", "fc"], init_lora_weights=False))
    if cfg.get("hooks"):  # gradient hooks: a block's weight scaled, the embedding's upper rows masked
        model.blocks[2].qkv.weight.register_hook(lambda g: g * 0.5)
        rows = (torch.arange(VOCAB) < VOCAB // 2).float()[:, None]
        model.tok.weight.register_hook(lambda g: g * rows)
    return model


def optimizer(model, cfg: dict):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if p.dim() >= 2]
    no_decay = [p for n, p in trainable if p.dim() < 2]
    if cfg["optimizer"] == "adamw":
        # lr/eps = 1, not 1e6: adding the ranks' gradients in another order than one process does
        # (DistributedDataParallel does too) changes each gradient by rounding, ~1e-7 of the largest
        # term summed. Where a gradient is small next to eps, Adam's step is lr * g / eps: the
        # rounding difference is multiplied by lr/eps; and a gradient that is zero in exact
        # arithmetic (the attention key's bias) but +-1e-9 of rounding gets a step of +-lr whose
        # sign the rounding decides. With lr/eps = 1 the comparison tests the arithmetic, not that.
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0, "lr": 5e-4}], lr=1e-3, eps=1e-3)
    return torch.optim.SGD([{"params": decay, "weight_decay": 0.01},
                            {"params": no_decay, "lr": 0.05}], lr=0.1, momentum=0.9, dampening=0.1)


def freeze(model, cfg: dict, step: int) -> None:
    """Before step ``step``: each parameter's ``requires_grad`` as ``cfg["freezes"]`` (step -> {name:
    flag}) last set it up to that step (gradual freezing and unfreezing)."""
    wanted = {}
    for at in sorted(int(k) for k in cfg.get("freezes", {})):
        if at <= step:
            wanted.update(cfg["freezes"][str(at)])
    for name, flag in wanted.items():  # a parameter, or a block frozen whole
        try:
            model.get_parameter(name).requires_grad_(flag)
        except AttributeError:
            model.get_submodule(name).requires_grad_(flag)


def schedule(step: int) -> float:
    """The learning-rate multiplier of the tests' LambdaLR."""
    return 1.0 / (1.0 + 0.5 * step)


def batch(step: int, micro: int, rank: int):
    """Rank ``rank``'s micro-batch: token ids (and, for the MoE, which expert each token goes to:
    expert 0 always, expert 1 only on rank 0, expert 2 only on odd steps, expert 3 never)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, VOCAB, (2, CONTEXT + 1), generator=g)
    experts = [0] + ([1] if rank == 0 else []) + ([2] if step % 2 else [])
    route = torch.tensor(experts)[torch.randint(0, len(experts), (2, CONTEXT + 1), generator=g)]
    return ids, route


def loss_of(model, x, moe: bool = False) -> torch.Tensor:
    ids, route = x
    if moe:
        logits = model(ids, route)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    out = model(ids[:, :-1])
    logits = getattr(out, "logits", out)  # (a Hugging Face model's output)
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _kill_during_update(engine, step: int, after_units: int) -> None:
    """SIGKILL this process once ``after_units`` units of step ``step + 1`` are updated
    (``after_units`` -1: just before the step's intent is written, so the other ranks have
    written theirs and this one has not)."""
    import signal
    if after_units < 0:
        begin = engine._commits.session.committer.begin_step

        def killed(intent, **kw):
            if intent["step"] == step + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return begin(intent, **kw)
        engine._commits.session.committer.begin_step = killed
        return
    update, done = engine._update_unit, [0]

    def counted(unit, *args, **kwargs):
        if engine.step_count == step + 1:
            if done[0] == after_units:
                os.kill(os.getpid(), signal.SIGKILL)
            done[0] += 1
        return update(unit, *args, **kwargs)
    engine._update_unit = counted


def _kill_in_commit(engine, step: int, when: str) -> None:
    """SIGKILL this process as its snapshot commit of step ``step`` replaces the manifest
    (``when``: "before" or "after" the new manifest is written), on the commit's thread."""
    import signal
    files = engine._commits.session.files
    write = files.write_manifest

    def killed(manifest):
        if manifest["step"] == step and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        write(manifest)
        if manifest["step"] == step:
            os.kill(os.getpid(), signal.SIGKILL)
    files.write_manifest = killed


def _fail_commit(engine, step: int) -> None:
    """This rank's snapshot commit of step ``step`` fails as a full disk fails it (the manifest
    cannot be written); the process lives on."""
    from offload_core.errors import DiskFullError
    files = engine._commits.session.files
    write = files.write_manifest

    def full(manifest):
        if manifest["step"] == step:
            raise DiskFullError(f"{files.manifest_path}: no space left on the device (a test's)")
        write(manifest)
    files.write_manifest = full


def _fail_during_update(engine, step: int, after_units: int) -> None:
    """Raise an error (as the optimizer's code or an out-of-memory would) in the update of step
    ``step + 1`` once ``after_units`` units of it are updated."""
    update, done = engine._update_unit, [0]

    def failing(unit, *args, **kwargs):
        if engine.step_count == step + 1:
            if done[0] == after_units:
                raise RuntimeError("an error in the optimizer's code")
            done[0] += 1
        return update(unit, *args, **kwargs)
    engine._update_unit = failing


def _planned_again(engine, planning: float = 0.1, offloading: float = 0.02) -> None:
    """This rank's plan offloads activations (the disk taken as free), its planning step (the third)
    runs ``planning`` s longer in every block, and every block whose activations are offloaded
    ``offloading`` s longer: the plan looks faster than the one slowed step it replaced, and is not
    (:meth:`Plan.measure_again`)."""
    import time
    from tiered_offload.engine.plan_monitor import PlanMonitor
    from tiered_offload.engine.planner import DiskRates
    PlanMonitor._disk_rates = lambda self, m: DiskRates(1e11, 1e11, "test")
    streamer = engine._streamer
    forward = streamer.block_forward

    def slowed(i, args, kwargs):
        time.sleep((planning if engine.step_count == 2 else 0.0) + (offloading if streamer.modes[i] == "offload"
                                                                    else 0.0))
        return forward(i, args, kwargs)
    streamer.block_forward = slowed


def _fragment(engine, backwards: int) -> None:
    """The first ``backwards`` groups that pin a block's saved activations beside its buffers are
    refused, as a tier whose free room pinned copies split into holes too small for them refuses
    them (counted in ``engine.refused_groups``)."""
    from offload_core.errors import TierCapacityError
    get_group, engine.refused_groups = engine.store.get_group, []

    def fragmented(keys, tier=None):
        acts = [k for k in keys if "/activations" in k]
        if acts and len(keys) > 1 and len(engine.refused_groups) < backwards:
            engine.refused_groups.append(acts[0])
            raise TierCapacityError(f"cannot fit tensor {acts[0]!r}: largest free block too small (test)")
        return get_group(keys, tier)
    engine.store.get_group = fragmented


def _no_room_after_ahead(engine) -> None:
    """In backward, once the block below is gathered ahead, the host tier has no room left until
    the running block's gradients are reduced: its gradient slice out of memory until then (as
    when the lookahead had not brought it in yet, or pinned copies split the free room into holes
    too small for it)."""
    from offload_core.errors import TierCapacityError
    from tiered_offload import Tier
    store, streamer = engine.store, engine._streamer
    full, blocks, fillers = streamer.full, streamer.binding.blocks, []
    ahead, reduce = full.gather_ahead, engine._placement.sharding.reduce_gradients

    def fill() -> None:
        for size in (1 << 16, 1 << 14, 1 << 12):
            while True:
                key = f"filler/{len(fillers)}"
                store.register(key, (size,), torch.uint8, scratch=True)
                try:
                    store.get(key, "host")
                except TierCapacityError:
                    store.unregister(key)
                    break
                fillers.append(key)

    def no_room(unit):
        i = blocks.index(unit) + 1
        running = full._full.get(blocks[i].name) if i < len(blocks) else None
        if running is None or running.grads is None:  # not the backward of the block above
            return ahead(unit)
        key = engine._placement.grad_key(blocks[i])
        got = store.residency(key).get(Tier.HOST) if key else None
        if got is not None and not store.record(key).slots[Tier.HOST].pins:
            store.evict(key, "host").get()
        ahead(unit)
        fill()

    def reduced(*args, **kwargs):
        try:
            return reduce(*args, **kwargs)
        finally:
            while fillers:
                key = fillers.pop()
                store.release(key, "host")
                store.unregister(key)
    full.gather_ahead, engine._placement.sharding.reduce_gradients = no_room, reduced


def slowed_step_mode(mode: str, seconds: float = 0.15):
    """``UpdatePipeline.run`` with the steps in ``mode`` (``overlapped`` or ``deferred``) ``seconds``
    longer, inside the engine's time: a process (or rank) on which that mode measures slower."""
    import time
    from tiered_offload.engine.pipeline import UpdatePipeline
    run = UpdatePipeline.run

    def slowed(self, names, update, *, background, then=None, deferred=False):
        if (background and mode == "overlapped") or (deferred and mode == "deferred"):
            time.sleep(seconds)
        return run(self, names, update, background=background, then=then, deferred=deferred)
    return slowed


def main() -> int:
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    if not cfg.get("linger"):
        return run(out, cfg)
    try:
        return run(out, cfg)
    except Exception as e:  # a loop that catches the error and lives on (logs, retries, a notebook)
        return _linger(out, cfg, e)


def _linger(out: Path, cfg: dict, error: Exception) -> int:
    """Record the error in ``rank-R.error`` and stay alive up to ``cfg["linger"]`` seconds for every
    other rank's: exit 18 once they all have one, 19 if one had none by then."""
    import time
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (out / f"rank-{rank}.error").write_text(f"{type(error).__name__}: {error}")
    deadline = time.monotonic() + cfg["linger"]
    while time.monotonic() < deadline:
        if all((out / f"rank-{r}.error").exists() for r in range(world)):
            return 18
        time.sleep(0.05)
    return 19


def run(out: Path, cfg: dict) -> int:
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (a driver that saw it hang asks for its stacks)
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.get("timeout_s", 120)))
    rank = dist.get_rank()
    if cfg.get("kill_after") and cfg["kill_after"][0] == rank:  # SIGKILL this rank after that many seconds
        import signal
        import threading
        timer = threading.Timer(cfg["kill_after"][1], os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True  # (a rank that finished first exits)
        timer.start()
    if cfg.get("try_step_modes"):  # try the step deferred once the plan is final, whatever the disk's load
        os.environ["TIERED_OFFLOAD_DEFER_STEP"] = "try"
    if str(rank) in cfg.get("slow_step_mode", {}):
        from tiered_offload.engine.pipeline import UpdatePipeline
        UpdatePipeline.run = slowed_step_mode(cfg["slow_step_mode"][str(rank)])
    from tiered_offload import Engine, EngineConfig, Tier
    from tiered_offload.engine.step_in_backward import StepInBackward
    model = build(dict(cfg, layers=cfg["layers"] + (1 if cfg.get("odd_rank") == rank else 0)))
    durable = cfg.get("durable", False)
    # striped: each rank's directory in both roots (rank-R-of-W in each), the stripes 16 KiB (by weight: "3:1")
    storage = (f"posix:{out / 'state'},{out / 'stripe'}?stripe_bytes=16KiB"
               + (f"&stripe_weights={cfg['stripe_weights']}" if cfg.get("stripe_weights") else "")
               if cfg.get("striped") else out / "state")
    engine = Engine(model, optimizer(model, cfg), storage=storage, durable=durable,
                    resume="auto" if durable else False, host_memory=cfg["host_memory"], device="cpu",
                    commit_every=cfg.get("commit_every", 1),
                    init_from=cfg.get("init_from"),
                    # a device tier (of CPU memory here) with its own budget, as each rank's GPU
                    store_config={"device_budget_bytes": cfg["device_budget"]} if cfg.get("device_budget") else None,
                    config=EngineConfig(activations=cfg.get("activations_by_rank", {}).get(str(rank),
                                                                                         cfg.get("activations", "auto"))))
    if cfg.get("scheduler"):  # stepped by the engine; its state is saved with every step
        engine.attach_scheduler(torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule))
    if cfg.get("no_room_on_rank") == rank:  # this rank cannot hold a rest gradient buffer per micro-batch
        from tiered_offload.engine import micro_batches
        micro_batches._RestGradients.open = lambda self, schedule: False
    if cfg.get("planned_again_on_rank") == rank:  # its plan measured against the modes it replaced again
        _planned_again(engine)
    if cfg.get("fragmented_on_rank") == rank:  # its tier too fragmented for a block's activations beside it
        _fragment(engine, backwards=3)
    if cfg.get("no_room_after_ahead"):
        _no_room_after_ahead(engine)
    if cfg.get("kill") and cfg["kill"][0] == rank:  # SIGKILL this rank in the middle of a step's update
        _kill_during_update(engine, *cfg["kill"][1:])
    if cfg.get("kill_in_reduce") and cfg["kill_in_reduce"][0] == rank:  # SIGKILL it as it would reduce gradients
        import signal
        reduce = engine._placement.sharding.reduce_scatter_mean

        def killed(*args, **kwargs):
            if engine.step_count == cfg["kill_in_reduce"][1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return reduce(*args, **kwargs)
        engine._placement.sharding.reduce_scatter_mean = killed
    if cfg.get("kill_in_commit") and cfg["kill_in_commit"][0] == rank:  # SIGKILL it as it commits a step
        _kill_in_commit(engine, *cfg["kill_in_commit"][1:])
    if cfg.get("fail_commit") and cfg["fail_commit"][0] == rank:  # its commit of that step fails
        _fail_commit(engine, cfg["fail_commit"][1])
    if cfg.get("fail") and cfg["fail"][0] == rank:  # an error in the middle of a step's update on this rank
        _fail_during_update(engine, *cfg["fail"][1:])
    losses, step_modes, state_reads = [], [engine.step_mode], []
    activation_modes = []  # after each step
    in_backward = bool(cfg.get("in_backward"))  # the step in the last backward (step=True): no step()
    norms, torn = [], None  # each step's total gradient norm (clipped runs); the error that tore a step
    # (in the backward, clipped: clip_norm, each norm told as it is known)
    clipped = dict(clip_norm=cfg["clip"], on_norm=lambda n: norms.append(float(n))) if in_backward and cfg.get(
        "clip") else {}
    updated_in_backward = []  # per unit updated: whether it ran inside the backward
    update_unit = engine._update_unit
    engine._update_unit = lambda unit, *a: (updated_in_backward.append(StepInBackward.updating(engine)),
                                            update_unit(unit, *a))[1]
    # retear: the steps an earlier start of this job tore in the backward (any rank's record) run after it, clipped
    torn_steps = {s for f in out.glob("torn-rank-*.json") for s in json.loads(f.read_text())} if cfg.get(
        "retear") else set()
    while engine.step_count < cfg["steps"]:
        step = engine.step_count
        fuse = in_backward and step not in torn_steps  # this step in the backward
        freeze(model, cfg, step)
        hook = None
        if cfg.get("inf_grad") and cfg["inf_grad"][:2] == [rank, step]:  # this rank's gradient of a block: inf
            param = dict(model.named_parameters())[f"blocks.{cfg['inf_grad'][2]}.ln1.weight"]
            hook = param.register_hook(lambda g: g * float("inf"))
        if cfg.get("big_grad") and cfg["big_grad"][:2] == [rank, step]:  # this rank's embeddings' gradient: scaled
            hook = model.tok.weight.register_hook(lambda g: g * cfg["big_grad"][2])
        # this rank's micro-batches of this step are shorter (dropout draws less than in the others)
        cut = CONTEXT // 2 + 1 if cfg.get("short") == [rank, step] else CONTEXT + 1
        if cfg.get("fused"):  # the micro-batches through each block together
            ids = [batch(step, micro, rank)[0][:, :cut] for micro in range(cfg["accumulate"])]
            inputs = [x[:, :-1] for x in ids]
            targets = {id(i): x[:, 1:].flatten() for i, x in zip(inputs, ids)}
            nan = cfg.get("nan") == [rank, step]  # this rank's last micro-batch of this step: a NaN loss

            def loss_fn(out, b):
                logits = getattr(out, "logits", out)  # (a Hugging Face model's output)
                loss = F.cross_entropy(logits.flatten(0, 1), targets[id(b)]) / cfg["accumulate"]
                return loss * float("nan") if nan and b is inputs[-1] else loss
            try:
                losses += [x.item() for x in engine.forward_backward(inputs, loss_fn, step=fuse,
                                                                      **(clipped if fuse else {}))]
            except ClipTornError as e:
                torn = str(e)
                break
        for micro in range(0 if cfg.get("fused") else cfg["accumulate"]):
            if cfg.get("die") == [rank, step]:  # a rank that dies mid-step: its peers must not hang
                os._exit(17)
            ids, route = batch(step, micro, rank)
            if cfg.get("input_grad"):  # an input's gradient first (saliency): it adds into no weight
                emb = {}
                handle = model.tok.register_forward_hook(lambda mod, args, out: emb.update(out=out))
                torch.autograd.grad(loss_of(engine, (ids[:, :cut], route[:, :cut])), emb["out"])
                handle.remove()
            if cfg.get("dropped_forward"):  # a loss logged without no_grad: its graph is dropped, never backward
                loss_of(engine, (ids[:, :cut], route[:, :cut]), cfg.get("model") == "moe").item()
            loss = loss_of(engine, (ids[:, :cut], route[:, :cut]), cfg.get("model") == "moe") / cfg["accumulate"]
            if cfg.get("zero_grad_late") and micro == 0:  # PyTorch loops' other order: between forward and backward
                engine.zero_grad()
            last = fuse and micro == cfg["accumulate"] - 1
            losses.append(loss.item())
            try:
                engine.backward(loss, step=last, **(clipped if last else {}))
            except ClipTornError as e:
                torn = str(e)
                break
        if torn is not None:
            break
        if hook is not None:
            hook.remove()
        if fuse:
            step_modes.append(engine.step_mode)
            continue
        if cfg.get("clip_value"):
            engine.clip_grad_value_(cfg["clip_value"])
        if cfg.get("clip"):
            norms.append(float(engine.clip_grad_norm_(cfg["clip"])))
        engine.step()
        step_modes.append(engine.step_mode)
        activation_modes.append(list(engine.activation_modes or []))
        reads: dict[str, int] = {}  # per unit: its optimizer states' reads from the disk so far
        for k in engine.store.keys():
            if "/state" in k:
                name = k.split("/")[0]
                reads[name] = reads.get(name, 0) + engine.store.record(k).disk_reads
        state_reads.append(reads)
        if not cfg.get("zero_grad_late") and (step + 1) % cfg.get("zero_every", 1) == 0:
            engine.zero_grad()
    if torn is not None:  # (the engine refuses every call but close: its state mixes two steps)
        engine.close()
        if cfg.get("retear"):  # the next start of this job runs it after the backward, clipped (as train does)
            (out / f"torn-rank-{rank}.json").write_text(json.dumps(sorted(torn_steps | {step})))
        torch.save({"torn": torn, "step_count": engine.step_count, "losses": losses, "norms": norms,
                    "updated_in_backward": updated_in_backward}, out / f"rank-{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
        return 0
    weights = dict(engine.named_parameters())
    exported = [str(f) for f in engine.export_safetensors(out / "export", merged=cfg.get("export") == "merged")
                ] if cfg.get("export") else []
    result = {"losses": losses, "state_bytes": engine.state_bytes(), "local_state_bytes": engine.local_state_bytes(),
              "host_budget": engine.store.capacity("host"), "weights": weights if rank == 0 else None,
              "directory": str(engine.store.backend.location), "exported": exported,
              "gathered_ahead": engine._streamer.gathered_ahead, "collective_bytes": engine._placement.collective_bytes(),
              "activation_bytes": dict(engine._streamer.activation_bytes), "state_reads": state_reads,
              "disk_read": engine.store.stats.bytes_read[Tier.DISK],
              "disk_written": engine.store.stats.bytes_written[Tier.DISK],
              "refused_groups": getattr(engine, "refused_groups", []), "step_modes": step_modes,
              "activation_modes": activation_modes,
              "plan_reasons": list(engine.plan.reasons), "commits": type(engine._commits).__name__,
              "updated_in_backward": updated_in_backward, "norms": norms, "torn": torn,
              "step_count": engine.step_count,
              "grad_written": engine.store.stats.by_kind(("host->disk", "device->disk")).get("grad", 0)}
    engine.close()
    result["files_bytes"] = sum(f.stat().st_size for d in result["directory"].split(",") for f in Path(d).iterdir()
                                if f.is_file() and not f.name.startswith("."))
    torch.save(result, out / f"rank-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TIERED_OFFLOAD_DEVICE", "cpu")
    sys.exit(main())
