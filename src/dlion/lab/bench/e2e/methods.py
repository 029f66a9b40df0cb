"""The methods of ``dlion bench e2e``: names, groups and labels, and one method's model,
optimizer and DDP comm hook on one rank (:class:`MethodRun`)."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Callable, Optional

import torch

from dlion.lab import float_wire

if TYPE_CHECKING:
    from .instrument import Instrument

POWERSGD_ONE = tuple(f"g-{opt}-powersgd{r}" for opt in ("lion", "adamw") for r in (1, 2, 4))
POWERSGD_OV = tuple(m + "-ov" for m in POWERSGD_ONE)  # several buckets, overlapped: a process group per bucket
POWERSGD = POWERSGD_ONE + POWERSGD_OV
DDP_HOOKS = ("ddp-dlion-hook", "ddp-dlion-hook-1bit")  # D-Lion MaVo inside DDP (dlion.integrations.ddp)
BASELINES = ("compute", "sync-only", "g-adamw", "g-lion", "g-lion-bf16") + POWERSGD + DDP_HOOKS
DLION = tuple(f"d-{vote}-{comm}{ov}" for vote in ("mavo", "avg") for comm in ("allgather", "1bit", "pbit")
              for ov in ("", "-ov")) + ("d-mavo-quant", "d-mavo-quant-ov", "d-mavo-1bit-ov-rt", "d-mavo-1bit-ov-m16") \
    + ("d-mavo-1bit-1b", "d-mavo-1bit-rt-1b", "d-avg-1bit-1b") \
    + ("d-mavo-1bit-rt-dl", "d-mavo-1bit-rt-1b-dl", "d-avg-1bit-dl") \
    + ("d-mavo-1bit-ov-pt", "d-mavo-1bit-pt-1b", "d-mavo-1bit-pt-dl", "d-mavo-1bit-ov-rt-fb")
# -rt / -pt: ties="random" / "previous" (whatever --ties says); -1b: the whole model in one bucket, like
# PowerSGD; -fb: a first bucket of FIRST_BUCKET_MB, then --bucket-mb (DDP's small first bucket);
# -dl: delay=1 (Δ applied a step later, its exchange overlapping the next forward and backward)
HIER = ("h-mavo-1bit", "h-mavo-allgather", "h-avg-1bit")  # HierarchicalDistributedLion (needs --nodes)
# Methods that talk every H = --sync-every steps: LocalDistributedLion (MaVo or Avg, 1bit; -st: streaming=True) and
# DiLoCo (dlion.lab.diloco: AdamW or Lion inner steps, the pseudo-gradients averaged in fp32 or bf16, or with AdamW
# through torchft's quantised all-reduce in fp8 or Streaming DiLoCo's fp4; -st: Streaming DiLoCo, torchft's
# fragments, fragment_sync_delay and fragment_update_alpha)
LOCAL = ("d-local-mavo", "d-local-mavo-st", "d-local-avg", "d-local-avg-st")
DILOCO_UNQUANTISED = ("diloco-adamw", "diloco-lion", "diloco-adamw-bf16", "diloco-lion-bf16")
DILOCO_ONE_PIECE = DILOCO_UNQUANTISED + tuple(f"diloco-adamw-{q}" for q in float_wire.FORMATS)
DILOCO = DILOCO_ONE_PIECE + tuple(m + "-st" for m in DILOCO_ONE_PIECE)
SYNC_EVERY = LOCAL + DILOCO
METHODS = BASELINES + DLION + HIER + SYNC_EVERY
_MOMENTUM_SYNC = re.compile(r"^(d-.+)-ms(\d+|d)$")  # a D-Lion method + "-ms<K>": momenta averaged every K steps
_OWN_H = re.compile(r"^(.+)-h(\d+)$")  # a method that talks every H steps + "-h<K>": its own H, not --sync-every's


def split_sync_every(method: str) -> tuple[str, Optional[int]]:
    """``"d-local-avg-h25"`` → ``("d-local-avg", 25)``, ``"diloco-adamw-bf16-h100"`` →
    ``("diloco-adamw-bf16", 100)``: a method that talks every H steps may name its own H, so that one
    run times several H side by side. Any other name → ``(name, None)`` (H from ``--sync-every``)."""
    m = _OWN_H.match(method)
    if m is None or m.group(1) not in SYNC_EVERY:
        return method, None
    if int(m.group(2)) < 1:
        raise ValueError(f"{method}: H must be >= 1")
    return m.group(1), int(m.group(2))


def talks_every_h(method: str) -> bool:
    """Whether ``method`` (with or without its own ``-h<K>``) syncs every H steps, not every step."""
    return split_sync_every(method)[0] in SYNC_EVERY


def sync_every_of(method: str, default: int) -> Optional[int]:
    """The H that ``method`` syncs every (its ``-h<K>``, else ``default``); None for a method that
    talks every step."""
    return (split_sync_every(method)[1] or default) if talks_every_h(method) else None


def split_momentum_sync(method: str) -> tuple[str, object]:
    """``"d-mavo-1bit-ov-rt-ms100"`` → ``("d-mavo-1bit-ov-rt", 100)``; ``-msd`` → ``"doubling"``;
    a name without the suffix → ``(name, "none")``. Any D-Lion method takes the suffix
    (Lion Cub's momentum synchronisation: the ranks' momenta averaged in fp32)."""
    m = _MOMENTUM_SYNC.match(method)
    if m is None or m.group(1) not in DLION:
        return method, "none"
    k = m.group(2)
    if k != "d" and int(k) < 1:
        raise ValueError(f"{method}: the momentum sync interval must be >= 1")
    return m.group(1), "doubling" if k == "d" else int(k)


def applies_next_step(method: str) -> bool:
    """A D-Lion method with ``delay=1``: its Δ is applied, and its exchange waited for, in its next step."""
    return method.startswith("d-") and "dl" in split_momentum_sync(method)[0].split("-")[3:]


def is_method(name: str) -> bool:
    return split_momentum_sync(split_sync_every(name)[0])[0] in METHODS


GROUPS = {
    "all": BASELINES + DLION,
    "hier": HIER,
    "nodes": ("compute", "g-lion", "g-lion-powersgd4", "d-mavo-1bit", "h-mavo-1bit", "h-mavo-allgather"),
    "baselines": BASELINES,
    "peers": ("compute", "sync-only", "g-lion", "g-lion-bf16") + POWERSGD,
    "powersgd": POWERSGD,
    "dlion": DLION,
    "mavo": tuple(m for m in DLION if m.startswith("d-mavo")),
    "avg": tuple(m for m in DLION if m.startswith("d-avg")),
    "overlap": tuple(m for m in DLION if "-ov" in m),
    "local": ("compute", "d-mavo-1bit-ov-rt", "g-adamw-powersgd4-ov") + LOCAL + DILOCO_UNQUANTISED,
}
LABELS = {"compute": "compute only (no comm)", "sync-only": "sync only (1 value per bucket)",
          "g-adamw": "G-AdamW (DDP fp32)", "g-lion": "G-Lion (DDP fp32)", "g-lion-bf16": "G-Lion (DDP bf16 hook)",
          **{m: f"G-{'Lion' if 'lion' in m else 'AdamW'} (DDP PowerSGD rank {m[-1]})" for m in POWERSGD_ONE},
          **{m: f"G-{'Lion' if 'lion' in m else 'AdamW'} (DDP PowerSGD rank {m[-4]}, overlapped)"
             for m in POWERSGD_OV},
          "ddp-dlion-hook": "D-Lion MaVo as a DDP comm hook (allgather)",
          "ddp-dlion-hook-1bit": "D-Lion MaVo as a DDP comm hook (1bit)",
          "d-local-mavo": "Local D-Lion MaVo 1bit",  # (H: the result's sync_every)
          "d-local-mavo-st": "Local D-Lion MaVo 1bit streaming",
          "d-local-avg": "Local D-Lion Avg 1bit",
          "d-local-avg-st": "Local D-Lion Avg 1bit streaming",
          **{m: f"{'Streaming ' if m.endswith('-st') else ''}DiLoCo {'AdamW' if 'adamw' in m else 'Lion'} "
                f"{next((w for w in ('bf16', 'fp8', 'fp4') if w in m), 'fp32')}" for m in DILOCO}}
POWERSGD_START_ITER = 2  # PowerSGD needs >= 2 uncompressed iterations (DDP rebuilds buckets after the first)
POWERSGD_BUCKET_MB = 1 << 16  # one bucket for PowerSGD (see MethodRun)
FIRST_BUCKET_MB = 2.0  # -fb methods: on CharGPT the one block-5 MLP matrix, like DDP's 1 MiB first bucket (which closes
# once it reaches its cap; ours before it would pass it)
PROFILE_RANGES = ("dlion.contribute", "dlion.exchange", "dlion.apply")


def add_local_vote_args(ap) -> None:
    """``--abstain-below TAU``, ``--outer-scale A``, ``--reset-momentum``, ``--stream-delay``, ``--fragments`` and
    ``--fragment-alpha`` for e2e and ttq alike (checked by :func:`methods_from_args`)."""
    ap.add_argument("--abstain-below", type=float, default=0.0, metavar="TAU",
                    help="d-local-*: a rank abstains where its round's progress is below TAU times the round's summed "
                         "lr (LocalDistributedLion(abstain_below=TAU)); default 0")
    ap.add_argument("--outer-scale", type=float, default=1.0, metavar="A",
                    help="d-local-*: the agreed step is A times the round's summed lr "
                         "(LocalDistributedLion(outer_scale=A)); default 1")
    ap.add_argument("--reset-momentum", action="store_true",
                    help="d-local-*: every rank's Lion momentum back to 0 at each sync "
                         "(LocalDistributedLion(reset_momentum=True))")
    ap.add_argument("--stream-delay", type=int, default=None, metavar="STEPS",
                    help="d-local-*-st: apply the round in flight STEPS steps into the next round instead of at its "
                         "end (LocalDistributedLion(stream_delay=STEPS)); default: at its end. diloco-*-st: start "
                         "each fragment's exchange STEPS steps before its round ends (torchft's fragment_sync_delay, "
                         "< H/P); default H/P - 1")
    ap.add_argument("--fragments", type=int, default=1, metavar="P",
                    help="d-local-*-st and diloco-*-st: the model in P fragments with staggered rounds, an exchange "
                         "of 1/P of the bytes every H/P steps (LocalDistributedLion(fragments=P); needs P buckets, "
                         "--bucket-mb; DiLoCo: H a multiple of P); default 1")
    ap.add_argument("--fragment-alpha", type=float, default=0.0, metavar="ALPHA",
                    help="diloco-*-st: after a fragment's sync, its parameters (1 - ALPHA) x the new global ones + "
                         "ALPHA x the local ones (torchft's fragment_update_alpha); default 0")


def methods_from_args(ap, args) -> list[str]:
    """``--methods`` parsed, ``--sync-every``, ``--abstain-below``, ``--outer-scale``, ``--reset-momentum``,
    ``--stream-delay``, ``--fragments`` and ``--fragment-alpha`` checked, or the parser's error (for e2e and ttq)."""
    try:
        methods = parse_methods(args.methods)
    except ValueError as e:
        ap.error(str(e))
    if args.sync_every < 1:
        ap.error(f"--sync-every must be >= 1, got {args.sync_every}")
    local = {m for m in methods if split_sync_every(m)[0] in LOCAL}
    if not args.abstain_below >= 0:
        ap.error(f"--abstain-below must be >= 0, got {args.abstain_below}")
    if not 0 < args.outer_scale < float("inf"):
        ap.error(f"--outer-scale must be > 0, got {args.outer_scale}")
    if args.outer_scale != 1.0 and not local:
        ap.error("--outer-scale applies to the local vote only: add a d-local-* method to --methods")
    if args.reset_momentum and not local:
        ap.error("--reset-momentum applies to the local vote only: add a d-local-* method to --methods")
    streamed = [m for m in methods if split_sync_every(m)[0] in SYNC_EVERY and split_sync_every(m)[0].endswith("-st")]
    diloco_st = [m for m in streamed if m.startswith("diloco-")]
    if args.stream_delay is not None:
        lowest = 0 if diloco_st and len(diloco_st) == len(streamed) else 1  # (DiLoCo's τ = 0: no overlap)
        if args.stream_delay < lowest:
            ap.error(f"--stream-delay must be >= {lowest}, got {args.stream_delay}")
        if not streamed:
            ap.error("--stream-delay applies to the streamed methods only: add d-local-mavo-st, d-local-avg-st or "
                     "diloco-*-st to --methods")
    if args.fragments != 1:
        if args.fragments < 1:
            ap.error(f"--fragments must be >= 1, got {args.fragments}")
        if not streamed:
            ap.error("--fragments applies to the streamed methods only: add d-local-mavo-st, d-local-avg-st or "
                     "diloco-*-st to --methods")
        if args.fragments > min(sync_every_of(m, args.sync_every) for m in streamed):
            ap.error(f"--fragments {args.fragments} must be <= the streamed method's H")
    for m in diloco_st:
        h = sync_every_of(m, args.sync_every)
        if h % args.fragments:
            ap.error(f"{m}: H = {h} must be a multiple of --fragments {args.fragments} (torchft's rule)")
        if args.stream_delay is not None and args.stream_delay >= h // args.fragments:
            ap.error(f"{m}: --stream-delay {args.stream_delay} must be < H / P = {h // args.fragments}")
    if not 0.0 <= args.fragment_alpha <= 1.0:
        ap.error(f"--fragment-alpha must be between 0 and 1, got {args.fragment_alpha}")
    if args.fragment_alpha and not diloco_st:
        ap.error("--fragment-alpha applies to Streaming DiLoCo only: add a diloco-*-st method to --methods")
    if args.abstain_below and not local:
        ap.error("--abstain-below applies to the local vote only: add d-local-mavo, d-local-mavo-st, d-local-avg or d-local-avg-st "
                 "to --methods")
    return methods


def takes_ties(method: str) -> bool:
    """Whether ``method`` ties as ``--ties`` says (D-Lion without -rt / -pt, and the DDP hook). The flat averaged
    vote (``d-avg-*``, ``d-local-avg*``) applies a zero sum as 0 whatever ``ties`` says (tests/test_local.py)."""
    parts = method.split("-")
    if method.startswith(("d-avg-", "d-local-avg")):
        return False
    return (method.startswith(("d-", "h-")) and not {"rt", "pt"} & set(parts[3:])) or method.startswith("ddp-dlion")


def label(method: str) -> str:
    if method in LABELS:
        return LABELS[method]
    base, h = split_sync_every(method)
    if h is not None:
        return f"{LABELS[base]}, H = {h}"
    method, sync = split_momentum_sync(method)
    if sync != "none":
        return label(method) + (" +momentum sync (doubling)" if sync == "doubling" else f" +momentum sync /{sync}")
    parts = method.split("-")
    if parts[0] == "h":
        return f"Hierarchical D-Lion {'MaVo' if parts[1] == 'mavo' else 'Avg'} {parts[2]}"
    vote, comm, ov, rt, m16 = parts[1], parts[2], "ov" in parts[3:], "rt" in parts[3:], "m16" in parts[3:]
    comm = {"quant": "quantized int8", "allgather": "allgather (naive)"}.get(comm, comm)
    return (f"D-Lion {'MaVo' if vote == 'mavo' else 'Avg'} {comm}{' +overlap' if ov else ''}"
            f"{' +random ties' if rt else ''}{' +previous-vote ties' if 'pt' in parts[3:] else ''}"
            f"{' +bf16 momentum' if m16 else ''}"
            f"{', one bucket' if '1b' in parts[3:] else ''}{' +delay 1' if 'dl' in parts[3:] else ''}"
            f"{f' +{FIRST_BUCKET_MB:g} MB first bucket' if 'fb' in parts[3:] else ''}")


def parse_methods(text: str) -> list[str]:
    out: list[str] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        names = GROUPS.get(item, (item,))
        for n in names:
            if not is_method(n):
                raise ValueError(f"unknown method {n!r}; choose from {', '.join(METHODS)} "
                                 f"or the groups {', '.join(GROUPS)}; a D-Lion method may end in -ms<K> "
                                 "(momenta averaged every K steps) or -msd (after steps 1, 2, 4, 8, …), and one "
                                 "that talks every H steps (d-local-*, diloco-*) in -h<K> (its own H)")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError("no methods given")
    return out


def _noop_hook(state, bucket):
    """No communication: hand DDP its own local gradient back as a completed future."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _sync_only_hook(state, bucket):
    """Synchronisation without payload: one all-reduce of one element per bucket, the local
    gradient handed back. Shows what ranks waiting for each other costs on this machine."""
    buf = bucket.buffer()
    fut = torch.distributed.all_reduce(buf[:1].clone(), async_op=True).get_future()
    return fut.then(lambda _: buf)


def _counting(inner: Callable, tally: dict) -> Callable:
    """Wrap a DDP comm hook: tally the fp32 bucket bytes it is handed (the traffic it
    then sends is counted by :class:`Instrument` at ``all_reduce``)."""
    def hook(state, bucket):
        buf = bucket.buffer()
        tally["buckets"] += 1
        tally["bucket_bytes"] += buf.numel() * buf.element_size()
        return inner(state, bucket)
    return hook


class PowerSGDPerBucket:
    """PyTorch's ``powerSGD_hook`` on several DDP buckets, overlapped with backward, on Gloo.

    The hook issues a bucket's first all-reduce from backward and its P and Q all-reduces
    from completion callbacks, whose timing differs between ranks; on one process group,
    Gloo (which pairs collectives by issue order) would pair one bucket's P with another's
    Q. Here every bucket has its own process group and its own ``PowerSGDState`` (error
    feedback and warm start, the defaults): on each group the ranks issue the same sequence.
    ``PowerSGDState`` counts iterations on the last bucket only, so the shared count is
    handed to each bucket's state before its hook runs."""

    def __init__(self, model: torch.nn.Module, cap_mb: float, *, rank: int, seed: int):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        from dlion.integrations.ddp import per_bucket_groups

        self._hook = powerSGD_hook.powerSGD_hook
        self.states = [powerSGD_hook.PowerSGDState(
            process_group=g, matrix_approximation_rank=rank, start_powerSGD_iter=POWERSGD_START_ITER,
            use_error_feedback=True, warm_start=True, random_seed=seed) for g in per_bucket_groups(model, cap_mb)]
        self.iter = 0

    def __call__(self, state, bucket):  # (DDP's hook signature; `state` is None)
        k = bucket.index()
        if k >= len(self.states):
            raise RuntimeError(f"DDP made bucket {k}; only {len(self.states)} process groups were created")
        state = self.states[k]
        state.iter = self.iter
        fut = self._hook(state, bucket)
        if bucket.is_last():
            self.iter += 1
        return fut


def _build_model(cfg: dict, vocab_size: int):
    from dlion.lab.models import CharGPT

    torch.manual_seed(cfg["seed"])  # identical on every rank: no initial broadcast needed
    return CharGPT(vocab_size, block_size=cfg["block_size"], n_layer=cfg["n_layer"],
                   n_head=cfg["n_head"], n_embd=cfg["n_embd"])


def _dlion_class():
    from dlion import DistributedLion

    class SeededDistributedLion(DistributedLion):
        """Every rank builds the model from the same seed, so rank 0's parameter broadcast
        (seconds of set-up on a slow link) is skipped; check_replicas() verifies it."""

        broadcast_at_start = False

    return SeededDistributedLion


_MESH: dict = {}


def _node_mesh(per_node: int):
    """The (node, local) mesh of this process group, built once per process (it creates groups)."""
    if per_node not in _MESH:
        from dlion.hierarchical import node_mesh

        _MESH[per_node] = node_mesh("cpu", per_node)
    return _MESH[per_node]


def _hier_class():
    from dlion import HierarchicalDistributedLion

    class SeededHierarchicalDistributedLion(HierarchicalDistributedLion):
        """As SeededDistributedLion: the model is built from the same seed everywhere."""

        broadcast_at_start = False

    return SeededHierarchicalDistributedLion


def _local_class():
    from dlion import LocalDistributedLion

    class SeededLocalDistributedLion(LocalDistributedLion):
        """As SeededDistributedLion; and (streaming) the byte counters at the moment each round's
        exchange completed, by the step that issued it (:meth:`MethodRun.step` brackets the window)."""

        def __init__(self, *args, **kwargs):
            self.settled_bytes: dict = {}  # issuing step -> (bytes sent, received) once that round completed
            super().__init__(*args, **kwargs)

        broadcast_at_start = False

        def settle(self) -> None:
            pending = self.in_flight_step
            super().settle()
            if pending is not None:
                self.settled_bytes[pending] = (self.comm_stats.bytes_sent, self.comm_stats.bytes_received)

    return SeededLocalDistributedLion


def _diloco(method: str, model, cfg: dict, lr: float, betas: tuple, wd: float, fused: bool):
    """DiLoCo (:mod:`dlion.lab.diloco`): AdamW inner steps at 10 × the Lion lr and wd / 10 (as G-AdamW),
    or Lion; the pseudo-gradients averaged in fp32, or bf16 (-bf16), or through the quantised all-reduce
    (-fp8, -fp4: :mod:`dlion.lab.quantised_allreduce`); the outer Nesterov SGD at --outer-lr;
    -st: Streaming DiLoCo in --fragments P, each exchange started --stream-delay τ steps before its round
    ends (default H/P − 1, the most torchft allows), mixed back with --fragment-alpha."""
    import dlion
    from dlion.lab.diloco import OUTER_LR, DiLoCo

    if "adamw" in method:
        inner = torch.optim.AdamW(model.parameters(), lr=10 * lr, weight_decay=wd / 10,
                                  **({"fused": True} if fused else {}))
    else:
        inner = dlion.Lion(model.parameters(), lr=lr, betas=betas, weight_decay=wd, fused=fused)
    h, streamed = cfg.get("sync_every", 10), method.endswith("-st")
    p = cfg.get("fragments", 1) if streamed else 1
    delay = cfg.get("stream_delay") if streamed else 0
    return DiLoCo(model.parameters(), inner, sync_every=h, outer_lr=cfg.get("outer_lr", OUTER_LR),
                  wire_dtype=torch.bfloat16 if "-bf16" in method else torch.float32,
                  quantize=next((q for q in float_wire.FORMATS if f"-{q}" in method), None), fragments=p,
                  sync_delay=h // p - 1 if delay is None else delay,
                  update_alpha=cfg.get("fragment_alpha", 0.0) if streamed else 0.0)


class MethodRun:
    """One method's model and optimizer on one rank, stepped by the driver loop."""

    def __init__(self, method: str, rank: int, cfg: dict, vocab_size: int, inst: Instrument):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        import dlion

        self.method, self.rank, self.inst = method, rank, inst  # (the name results are keyed by)
        self.kind, own_h = split_sync_every(method)  # (what it is: the name without its own H)
        if own_h is not None:
            cfg = {**cfg, "sync_every": own_h}
        method = self.kind
        self.model = model = _build_model(cfg, vocab_size)
        self.params = sum(p.numel() for p in model.parameters())
        lr, betas, wd = cfg["lr"], tuple(cfg.get("betas", (0.9, 0.99))), cfg["weight_decay"]
        fused = bool(cfg.get("fused"))  # each optimizer's fused CPU kernel (--fused)
        self.tally = {"buckets": 0, "bucket_bytes": 0}
        self.is_ddp = method in BASELINES
        if self.is_ddp:
            # gradient_as_bucket_view: no copy between gradients and buckets (DDP's fastest setting).
            # PowerSGD on one process group gets a single bucket: its hook issues collectives from
            # completion callbacks, so with several buckets in flight the ranks issue them in different
            # orders, which Gloo (matching collectives by issue order) aborts on ("Received data size
            # doesn't match"). The -ov methods give each bucket a group of its own (PowerSGDPerBucket).
            cap = POWERSGD_BUCKET_MB if method in POWERSGD_ONE else cfg["bucket_mb"]
            self.net = DDP(model, init_sync=False, bucket_cap_mb=cap, gradient_as_bucket_view=True)
            if method == "compute":
                hook, state = _noop_hook, None
            elif method == "sync-only":
                hook, state = _sync_only_hook, None
            elif method == "g-lion-bf16":
                hook, state = default_hooks.bf16_compress_hook, None
            elif method in DDP_HOOKS:
                from dlion.integrations.ddp import DLionHookState, dlion_hook

                hook = dlion_hook
                state = DLionHookState(model, betas=betas, vote="mavo", ties=cfg["ties"], bucket_cap_mb=cap,
                                       comm="1bit" if method.endswith("-1bit") else "allgather",
                                       fused=fused)
                self.hook_state = state  # its comm_stats count what the hook sends (all-gathers, not all-reduces)
            elif method in POWERSGD_ONE:  # error feedback and warm start: PowerSGDState's defaults
                hook = powerSGD_hook.powerSGD_hook
                state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(method[-1]),
                                                    start_powerSGD_iter=POWERSGD_START_ITER,
                                                    use_error_feedback=True, warm_start=True,
                                                    random_seed=cfg["seed"])
            elif method in POWERSGD_OV:
                hook, state = PowerSGDPerBucket(model, cap, rank=int(method[-4]), seed=cfg["seed"]), None
            else:
                hook, state = default_hooks.allreduce_hook, None
            self.net.register_comm_hook(state, _counting(hook, self.tally))
            if method in DDP_HOOKS:
                from dlion.integrations.ddp import ApplyDelta

                self.opt = ApplyDelta(model.named_parameters(), lr=lr, weight_decay=wd)
            elif method.startswith("g-adamw"):
                self.opt = torch.optim.AdamW(model.parameters(), lr=10 * lr, weight_decay=wd / 10,
                                             **({"fused": True} if fused else {}))
            else:
                self.opt = dlion.Lion(model.parameters(), lr=lr, betas=betas, weight_decay=wd, fused=fused)
        elif method in HIER:
            _, vote, comm = method.split("-")
            if not cfg.get("per_node"):
                raise ValueError(f"{method} needs nodes: run with --nodes K --per-node L")
            self.net = model
            self.opt = _hier_class()(model.named_parameters(), lr=lr, betas=betas, weight_decay=wd, vote=vote,
                                     ties=cfg["ties"], comm=comm, bucket_cap_mb=cfg["bucket_mb"],
                                     mesh=_node_mesh(cfg["per_node"]), fused=fused)
            self.opt.check_replicas()
        elif method in LOCAL:
            self.net = model
            self.opt = _local_class()(model.named_parameters(), lr=lr, betas=betas, weight_decay=wd,
                                      vote=method.split("-")[2],
                                      ties=cfg["ties"], comm="1bit", sync_every=cfg.get("sync_every", 10),
                                      sync_warmup=cfg.get("sync_warmup", 0), abstain_below=cfg.get("abstain_below", 0.0),
                                      outer_scale=cfg.get("outer_scale", 1.0),
                                      reset_momentum=cfg.get("reset_momentum", False),
                                      streaming=method.endswith("-st"),
                                      stream_delay=cfg.get("stream_delay") if method.endswith("-st") else None,
                                      fragments=cfg.get("fragments", 1) if method.endswith("-st") else 1,
                                      bucket_cap_mb=cfg["bucket_mb"], fused=fused)
            self.opt.check_replicas()
        elif method in DILOCO:
            self.net = model
            self.opt = _diloco(method, model, cfg, lr, betas, wd, fused)
            self.opt.check_replicas()
        else:
            base, sync = split_momentum_sync(method)
            _, vote, comm, *rest = base.split("-")
            quant = comm == "quant"
            self.net = model
            self.opt = _dlion_class()(
                model.named_parameters(), lr=lr, betas=betas, weight_decay=wd, vote=vote,
                ties="random" if "rt" in rest else "previous" if "pt" in rest else cfg["ties"],
                comm="1bit" if quant else comm, aggregate="quantized" if quant else "sign",
                quant_bits=cfg["quant_bits"], overlap="ov" in rest,
                bucket_cap_mb=(POWERSGD_BUCKET_MB if "1b" in rest else
                               [FIRST_BUCKET_MB, cfg["bucket_mb"]] if "fb" in rest else cfg["bucket_mb"]),
                momentum_dtype=torch.bfloat16 if "m16" in rest else None, fused=fused, momentum_sync=sync,
                delay=1 if "dl" in rest else 0)
            self.opt.check_replicas()
        self.step_s: list[float] = []
        self.fwd_bwd_s: list[float] = []
        self.losses: list[float] = []
        self.profile_ms: dict[str, float] = {}  # (filled by profile(); a run that never profiles has none)
        self._start: Optional[tuple] = None

    def step(self, x, y, measure: bool) -> None:
        inst = self.inst
        first_wait = 0.0
        if measure and self._start is None:  # first measured step: bytes and profile from here on
            if applies_next_step(self.method):
                # the warm-up's last exchange completes here (its bytes before the window), and the wait
                # counts in this step: every measured step then waits for exactly one exchange
                t = time.perf_counter()
                self.opt.settle()
                first_wait = time.perf_counter() - t
            stats = getattr(self.opt, "comm_stats", None) or getattr(getattr(self, "hook_state", None), "comm_stats", None)
            self._start = ((stats.bytes_sent, stats.bytes_received) if stats is not None else None, dict(self.tally))
            local = getattr(self.opt, "local_stats", None)
            self._local_start = local.bytes_sent if local is not None else 0
            self._start_after = self.opt.in_flight_step if self.kind in LOCAL else None
            # streaming: a round issued before the window may still be on the wire; the window's bytes
            # start where it completes (SeededLocalDistributedLion.settle), untimed and unchanged
        if measure:
            self.uplink_before_step()
        inst.count = self.is_ddp
        inst.current = self.method if measure else None
        try:
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            _, loss = self.net(x, y)
            loss.backward()
            t1 = time.perf_counter()
            self.opt.step()
            t2 = time.perf_counter()
        finally:
            inst.current = None
        if measure:
            self.uplink_after_step()
            stats = getattr(self.opt, "comm_stats", None) or getattr(getattr(self, "hook_state", None), "comm_stats", None)
            if stats is not None:  # bytes up to the last measured step (the profiled steps come after)
                self._end = (stats.bytes_sent, stats.bytes_received)
                local = getattr(self.opt, "local_stats", None)
                self._local_end = local.bytes_sent if local is not None else 0
            self.step_s.append(t2 - t0 + first_wait)
            self.fwd_bwd_s.append(t1 - t0)
        self.losses.append(float(loss.detach()))

    #: set by the driver on every rank of a virtual cluster with nodes: count the bytes that cross
    #: the node uplinks during each measured step (a barrier after the step, outside the timing)
    count_uplinks = False
    #: on rank 0 only: () -> bytes sent so far on every node uplink, both directions (the kernel's
    #: qdisc counters: what really crossed between nodes, TCP/IP headers included)
    uplink_counter: Optional[Callable[[], int]] = None

    def uplink_before_step(self) -> None:
        if self.uplink_counter is not None:
            self._uplink_mark = self.uplink_counter()

    def uplink_after_step(self) -> None:
        if not self.count_uplinks:
            return
        torch.distributed.barrier()  # every rank's share of the step has crossed (plus this barrier)
        if self.uplink_counter is not None:
            self.uplink_bytes = getattr(self, "uplink_bytes", 0) + self.uplink_counter() - self._uplink_mark

    def end_measure(self) -> None:
        """After the last measured step: a ``delay=1`` method's last exchange completes (untimed:
        the first measured step waited for one already), so its bytes count in the window. A
        streaming local method's round in flight completes (untimed: the window's first round end
        waited for the one issued before it) and is applied (``flush``: nothing left in flight)."""
        if (applies_next_step(self.method) or self.kind in LOCAL) and self._start is not None:
            self.opt.settle()
            stats = self.opt.comm_stats
            self._end = (stats.bytes_sent, stats.bytes_received)
            if self.kind in LOCAL:
                self.opt.flush()

    def profile(self, batches: list) -> None:
        """D-Lion only: a few more (untimed) steps under ``torch.profiler``; the milliseconds per
        step inside the library's ranges (CPU time on the thread that records them: with
        overlap, ``dlion.contribute`` runs inside backward's gradient hooks, and the exchange
        thread's votes and decodes are not recorded at all: ``dlion.exchange`` is then the
        training thread's wait for it; the buckets applied while later ones are still on the
        wire count in ``dlion.apply`` and, nested, in ``dlion.exchange``)."""
        self.profile_ms = {}
        if self.is_ddp or self.kind in SYNC_EVERY:  # (a few steps hold no sync, or one: no per-step figure)
            return
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for x, y in batches:
                self.step(x, y, measure=False)
        for ev in prof.key_averages():
            if ev.key in PROFILE_RANGES:
                self.profile_ms[ev.key] = ev.cpu_time_total / 1e3 / len(batches)

    def result(self) -> dict:
        steps = len(self.step_s)
        inst, m, kind = self.inst, self.method, self.kind
        if self.is_ddp:
            sent = received = inst.bytes_sent.get(m, 0.0) / steps
            if m in DDP_HOOKS:
                sent = (self._end[0] - self._start[0][0]) / steps
                received = (self._end[1] - self._start[0][1]) / steps
            t0 = self._start[1]
            extra = {"all_reduce_calls_per_step": inst.all_reduce_calls.get(m, 0) / steps,
                     "buckets_per_step": (self.tally["buckets"] - t0["buckets"]) / steps,
                     "bucket_bytes_per_step": (self.tally["bucket_bytes"] - t0["bucket_bytes"]) / steps}
        else:
            b0 = self._start[0]
            if getattr(self, "_start_after", None) is not None:  # streaming: from the end of the round in flight
                b0 = self.opt.settled_bytes[self._start_after]
            sent = (self._end[0] - b0[0]) / steps
            received = (self._end[1] - b0[1]) / steps
            extra = {}
            if kind in SYNC_EVERY:  # bytes amortised over the window (steps / H syncs)
                extra = {"sync_every": self.opt.sync_every}
                if kind in DILOCO:
                    extra.update({"outer_lr": self.opt.outer_lr, "fragments": len(self.opt.fragments),
                                  "sync_delay": self.opt.sync_delay, "update_alpha": self.opt.update_alpha})
                else:
                    extra.update({"buckets": len(self.opt.buckets), "algorithms": sorted(set(self.opt.algorithm_names))})
                self.opt.check_replicas()  # the anchor / θ must be bitwise identical
            if m in HIER:  # comm_stats: between nodes; local_stats: inside the node
                intra = (self._local_end - self._local_start) / steps
                extra = {"inter_node_bytes_sent_per_step": sent, "intra_node_bytes_sent_per_step": intra}
                sent, received = sent + intra, received + intra
            if kind not in SYNC_EVERY:
                extra.update({"buckets": len(self.opt.buckets),
                              "algorithms": sorted(set(self.opt.algorithm_names)),
                              "profile_ms_per_step": self.profile_ms})
                self.opt.check_replicas()  # the replicas must still be bitwise identical
        if getattr(self, "uplink_bytes", None) is not None:
            extra["uplink_bytes_per_step"] = self.uplink_bytes / steps
        return {"method": m, "rank": self.rank, "params": self.params, "step_s": self.step_s,
                "fwd_bwd_s": self.fwd_bwd_s, "bytes_sent_per_step": sent, "bytes_received_per_step": received,
                "loss_first": self.losses[0], "loss_last": self.losses[-1], **extra}
