"""Methods, one training run, tuning and resumable sweeps.

A *method* turns the N workers' stacked gradients of one step into a parameter
update and counts its communication. A method is named by a *spec*: a base name,
optionally with its compression parameter after a colon — ``dgc:0.01`` (density
1 %), ``graddrop:0.001``, ``powersgd_lion:2`` (rank 2). Without one the default
below is used.

==================  ==================================================================  =========================
base                aggregation → update                                                default parameter
==================  ==================================================================  =========================
``glion``           fp32 mean → Lion
``gadamw``          fp32 mean → AdamW
``terngrad``        TernGrad (shared scale, clip 2.5σ) → SGD, momentum 0.9
``graddrop``        top-ρ of g + residual, one threshold per worker → AdamW              density ρ = 1 %
``dgc``             DGC (reference code: 1-D tensors dense, clipping, warm-ups) → DGCSGD  density ρ = 0.1 %
``powersgd_lion``   PowerSGD (error feedback, warm start) → Lion                        rank 1
``powersgd_adamw``  PowerSGD (error feedback, warm start) → AdamW                       rank 1
``dlion_avg``       D-Lion, Δ = mean of signs
``dlion_mavo``      D-Lion, Δ = sign(Σ signs) (majority vote), a tie gives 0
``dlion_mavo_rties`` D-Lion MaVo, a tie broken by a shared coin (``ties="random"``)
``lioncub_quant``   Lion Cub: c quantised (L1 scale, 8-bit fields), Δ = sign Σq
``lioncub_msync``   Lion Cub: MaVo + fp32 momentum averaging every K = 32 steps
==================  ==================================================================  =========================

**Methods that talk every H steps** (:mod:`.local_steps`; every worker has its own
parameters, the anchor is evaluated). Spec ``BASE:H`` (default H = 10), options as
further ``:key=value`` fields, e.g. ``dlocal_mavo:25:alpha=0.5:ef=0:ties=random``,
``diloco_lion:10:outer_lr=0.1``:

======================  ================================================================  ==============================
base                    round (H local steps, then)                                       options (default)
======================  ================================================================  ==============================
``dlocal_mavo``         local Lion; anchor ← anchor − α·Σlr·sign(Σ sign(e_i)) (1-bit       ``alpha`` (1), ``ef`` (1: error
                        vote of the displacements with error feedback)                     feedback), ``ties`` (zero|random)
                        (``ob1``, ``ob2`` > 0: the step is sign(ob1·M + (1 − ob1)·Δ),      ``ob1``, ``ob2`` (0: off)
                        M ← ob2·M + (1 − ob2)·Δ, Lion's rule on the votes; an experiment)
                        (``osoft=1``: that step without its sign; ``esc=1``: the step is   ``osoft``, ``esc`` (0: off)
                        α·mean_i mean|e_i| per tensor instead of α·Σlr; experiments;      ``vote`` (mavo|avg|count|mean)
                        ``vote=avg``: Δ = mean_i sign(e_i), D-Lion Avg's rule;
                        ``vote=count``: each rank's integer count k_i of Lion steps in
                        [−H, H], A ← A − α·(S/H)·mean_i k_i; ``vote=mean``: the exact
                        fp32 mean of the progress, a bound; :func:`.local_steps.count_round`)
                        (``sw=K``, ``h0=H0``: rounds of H0 steps for the first K steps,    ``sw`` (0), ``h0`` (1)
                        then of H; ``h0=1`` is the library's ``sync_warmup=K``)
                        (``mr=1``: every rank's Lion momentum reset to 0 at each sync;     ``mr`` (0: off)
                        the library's ``reset_momentum=True``)
                        (``st=1``: streamed, each round's vote applied when the next       ``st`` (0), ``fr`` (1),
                        ends; ``fr=P``: in the library's P fragments of buckets of         ``bmb`` (25)
                        ``bmb`` MB, ``streaming=True, fragments=P``; ``sd=τ``:             ``sd`` (none)
                        ``stream_delay=τ``, and 0 applies at once, a diagnostic;           ``ra`` (0)
                        ``ra=1``: the momenta reset where each vote is applied, the
                        library's rule since 2026-11-28; 0: where its exchange leaves,
                        the rule before; diagnostics of the delay, ``kd=K``: keep only     ``kd`` (1), ``rs`` (0),
                        K of the progress made during it; ``rs=1``: restart each round     ``mix`` (0)
                        from the anchor; ``mix=M``: x ← M·x + (1 − M)·(A' + s), Streaming
                        DiLoCo's merge)
                        (``inner=adamw``: AdamW local steps, at G-AdamW's lr and weight    ``inner`` (lion)
                        decay, instead of Lion's; an experiment: S is then AdamW's lr
                        summed, ``esc=1`` scales the step by the progress itself)
``diloco_adamw``        local AdamW; fp32 mean pseudo-gradient → outer Nesterov SGD        ``outer_lr`` (0.7),
                        (``wire=fp8|fp4``: torchft's quantised all-reduce, row-wise        ``outer_momentum`` (0.9),
                        scales, fp8 E4M3 or Streaming DiLoCo's fp4 E3M0;                  ``wire`` (fp32)
                        :func:`.local_steps.quantize_rows`)
``diloco_lion``         local Lion; the same outer step                                   as above
``diloco_adamw_bf16``   as ``diloco_adamw``, pseudo-gradients sent in bf16                 as above, no ``wire``
``diloco_lion_bf16``    as ``diloco_lion``, pseudo-gradients sent in bf16                  as above, no ``wire``
======================  ================================================================  ==============================

Their learning rate and weight decay, when a config does not name the spec, are those
of the every-step method with the same inner optimizer (``glion`` for the Lion ones,
``gadamw`` for the AdamW ones; :func:`hparams_for`).

**Bits, one axis for all:** every record's ``bits`` is what *one rank sends* per
parameter per step (mean over the run) under the method's best collective —
fp32 ring all-reduce 2·32·(N−1)/N for G-Lion / G-AdamW, the all-reduces of P and
Q for PowerSGD, all-gathers of (value, index) pairs for the sparse methods, the
1-bit all-reduce (all-to-all + all-gather) for D-Lion and Lion Cub. The baselines
are counted by :mod:`dlion.lab.experiments.baselines` from their wire formats;
D-Lion and Lion Cub are counted by :class:`dlion.simulate.SimulatedDistributedLion`
from the bytes its simulated collectives carry (the real wire formats, headers
included). Both are *counted*, not measured on a network. Records written
before this axis was introduced (``bits_axis`` absent) are converted by
:func:`common_bits`.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from typing import Optional

import torch

from dlion.lion import Lion
from dlion.simulate import SimulatedDistributedLion

from .. import float_wire
from . import baselines as B
from . import local_steps as L
from .tasks import ShakespeareTask, Task, make_task

__all__ = ["METHODS", "LOCAL_METHODS", "ALL_METHODS", "local_options", "LABELS", "GRIDS", "DEFAULTS", "make_method", "run_one", "run_key", "sweep", "tune",
           "load_runs", "run_real", "dlion_options", "MOMENTUM_SYNC_K", "parse_method", "canonical", "label", "family", "common_bits",
           "dgc_clip", "beta2_of", "quant_bits_of", "BITS_AXIS"]

MOMENTUM_SYNC_K = 32
BITS_AXIS = "per_rank_sent"
IMPL = 2                   # 2: the audited baselines (DGC after its reference code, GradDrop global threshold)

METHODS = ("glion", "gadamw", "terngrad", "graddrop", "dgc", "powersgd_lion", "powersgd_adamw", "dlion_avg",
           "dlion_mavo", "dlion_mavo_rties", "lioncub_quant", "lioncub_msync")

# methods that talk every H steps (local_steps.py); not part of "all" (every-step methods)
LOCAL_METHODS = ("dlocal_mavo", "diloco_adamw", "diloco_lion", "diloco_adamw_bf16", "diloco_lion_bf16")
ALL_METHODS = METHODS + LOCAL_METHODS
DEFAULT_H = 10
# options of a local-step spec, in their canonical order, with defaults
LOCAL_OPTIONS = {"dlocal_mavo": {"alpha": 1.0, "ef": 1, "ties": "zero", "ob1": 0.0, "ob2": 0.0, "ab": 0.0,
                                 "esc": 0, "osoft": 0, "vote": "mavo", "sw": 0, "h0": 1, "mr": 0,
                                 "st": 0, "fr": 1, "bmb": 25.0, "sd": -1, "kd": 1.0, "rs": 0, "mix": 0.0, "ra": 0,
                                 "inner": "lion"},
                 **{b: {"outer_lr": 0.7, "outer_momentum": 0.9, **({} if b.endswith("_bf16") else {"wire": "fp32"})}
                    for b in LOCAL_METHODS if b.startswith("diloco")}}
# the every-step method whose tuned lr / weight decay a local-step method takes by default
LOCAL_TWIN = {"dlocal_mavo": "glion", "diloco_adamw": "gadamw", "diloco_adamw_bf16": "gadamw",
              "diloco_lion": "glion", "diloco_lion_bf16": "glion"}

LABELS = {
    "glion": "G-Lion", "gadamw": "G-AdamW", "terngrad": "TernGrad", "graddrop": "GradDrop", "dgc": "DGC",
    "powersgd_lion": "PowerSGD + Lion", "powersgd_adamw": "PowerSGD + AdamW",
    "dlion_avg": "D-Lion Avg", "dlion_mavo": "D-Lion MaVo", "dlion_mavo_rties": "D-Lion MaVo (random ties)",
    "lioncub_quant": "Lion Cub quant (L1, 8b)",
    "lioncub_msync": f"Lion Cub MaVo+msync K={MOMENTUM_SYNC_K}",
    "dlocal_mavo": "D-Local MaVo", "diloco_adamw": "DiLoCo (AdamW)", "diloco_lion": "DiLoCo (Lion)",
    "diloco_adamw_bf16": "DiLoCo (AdamW, bf16)", "diloco_lion_bf16": "DiLoCo (Lion, bf16)",
}

# the compression parameter of a spec: (kind, default)
PARAMS = {"graddrop": ("density", 0.01), "dgc": ("density", 0.001), "powersgd_lion": ("rank", 1),
          "powersgd_adamw": ("rank", 1)}

FAMILY = {"glion": "lion", "dlion_avg": "lion", "dlion_mavo": "lion", "dlion_mavo_rties": "lion", "lioncub_quant": "lion",
          "lioncub_msync": "lion", "powersgd_lion": "lion", "gadamw": "adamw", "graddrop": "adamw",
          "powersgd_adamw": "adamw", "terngrad": "sgdm", "dgc": "sgdm",
          "dlocal_mavo": "lion", "diloco_lion": "lion", "diloco_lion_bf16": "lion",
          "diloco_adamw": "adamw", "diloco_adamw_bf16": "adamw"}


def local_options(spec: str) -> dict:
    """H and the options of a local-step spec ``BASE[:H[:key=value]...]``, defaults filled in:
    ``local_options("dlocal_mavo:25:ef=0")`` → {"H": 25, "alpha": 1.0, "ef": 0, "ties": "zero", "ob1": 0.0,
    "ob2": 0.0, "ab": 0.0} (``ob1``, ``ob2``: Lion's two betas on the votes, off at 0; an experiment; ``ab``:
    ``abstain_below``, τ)."""
    base, *fields = spec.split(":")
    if base not in LOCAL_METHODS:
        raise ValueError(f"{base!r} is no local-step method ({', '.join(LOCAL_METHODS)})")
    out = {"H": DEFAULT_H, **LOCAL_OPTIONS[base]}
    if fields and fields[0] != "":
        try:
            h = float(fields[0])
        except ValueError:
            raise ValueError(f"the second field of {spec!r} must be H (steps per round)") from None
        if h != int(h) or h < 1:
            raise ValueError(f"H must be a positive integer, got {spec!r}")
        out["H"] = int(h)
    for f in fields[1:]:
        key, eq, value = f.partition("=")
        if not eq or key not in LOCAL_OPTIONS[base]:
            raise ValueError(f"{base} takes the options {', '.join(k + '=' for k in LOCAL_OPTIONS[base])}, "
                             f"got {f!r} in {spec!r}")
        if key == "ties":
            if value not in ("zero", "random"):
                raise ValueError(f"ties must be zero or random, got {spec!r}")
            out[key] = value
        elif key == "vote":
            if value not in ("mavo", "avg") + L.VALUE_VOTES:
                raise ValueError(f"vote must be mavo, avg, mean or count, got {spec!r}")
            out[key] = value
        elif key == "wire":
            if value not in ("fp32",) + float_wire.FORMATS:
                raise ValueError(f"wire must be fp32, {', '.join(float_wire.FORMATS)} (bf16: the _bf16 method), "
                                 f"got {spec!r}")
            out[key] = value
        elif key == "inner":
            if value not in ("lion", "adamw"):
                raise ValueError(f"inner must be lion or adamw, got {spec!r}")
            out[key] = value
        elif key in ("sw", "h0", "fr", "sd"):
            if not value.isdigit() or (key in ("h0", "fr") and int(value) < 1):
                raise ValueError(f"{key} must be an integer >= {0 if key == 'sw' else 1}, got {spec!r}")
            out[key] = int(value)
        elif key in ("ef", "esc", "osoft", "mr", "st", "rs", "ra"):
            if value not in ("0", "1"):
                raise ValueError(f"{key} must be 0 or 1, got {spec!r}")
            out[key] = int(value)
        else:
            try:
                v = float(value)
            except ValueError:
                v = float("nan")
            ok = (0 <= v < 1 if key in ("outer_momentum", "ob1", "ob2") else 0 <= v < float("inf") if key == "ab"
                  else 0 <= v <= 1 if key in ("kd", "mix") else v > 0)
            if not ok:
                raise ValueError(f"bad {key} in {spec!r}")
            out[key] = v
    return out


def parse_method(spec: str) -> tuple[str, Optional[float]]:
    """``"dgc:0.01"`` → ("dgc", 0.01); ``"dgc"`` → ("dgc", 0.001) (the default); ``"glion"`` → ("glion", None).
    DGC takes one more field, its local clipping threshold: ``"dgc:0.01:clip=1"`` (see :func:`dgc_clip`)."""
    base, _, arg = spec.partition(":")
    arg, _, extra = arg.partition(":")
    if base in LOCAL_METHODS:  # "dlocal_mavo:25:alpha=0.5" → ("dlocal_mavo", 25)
        return base, local_options(spec)["H"]
    if arg.startswith("b2="):  # a Lion-family method with another β2: "dlion_mavo:b2=0.99"
        if base not in METHODS or FAMILY[base] != "lion" or extra:
            raise ValueError(f"only a Lion-family method takes b2=BETA2, as its only field, got {spec!r}")
        beta2_of(spec)
        return base, None
    if arg.startswith("bits="):  # Lion Cub's quantised aggregation with another field width: "lioncub_quant:bits=4"
        if base != "lioncub_quant" or extra:
            raise ValueError(f"only lioncub_quant takes bits=B, as its only field, got {spec!r}")
        quant_bits_of(spec)
        return base, None
    if extra:
        if base != "dgc":
            raise ValueError(f"only dgc takes a third field (clip=C), got {spec!r}")
        dgc_clip(spec)
    if base not in METHODS:
        raise ValueError(f"unknown method {base!r}; choose from {', '.join(ALL_METHODS)}")
    if base not in PARAMS:
        if arg:
            raise ValueError(f"method {base!r} takes no parameter, got {spec!r}")
        return base, None
    kind, default = PARAMS[base]
    if not arg:
        return base, default
    try:
        value = float(arg)
    except ValueError:
        raise ValueError(f"bad {kind} in {spec!r}") from None
    if kind == "rank":
        if value != int(value) or value < 1:
            raise ValueError(f"rank must be a positive integer, got {spec!r}")
        return base, int(value)
    if not 0 < value <= 1:
        raise ValueError(f"density must be in (0, 1], got {spec!r}")
    return base, value


def dgc_clip(spec: str) -> Optional[float]:
    """DGC's global clipping threshold C of a spec ``dgc:DENSITY:clip=C`` (each worker clips its
    gradient to the L2 norm C/√N); None (no clipping, the reference code's default) without it."""
    parts = spec.split(":")
    if len(parts) < 3:
        return None
    key, _, value = parts[2].partition("=")
    try:
        clip = float(value)
    except ValueError:
        clip = -1.0
    if key != "clip" or len(parts) > 3 or not clip > 0:
        raise ValueError(f"DGC's third field must be clip=C with C > 0, got {spec!r}")
    return clip


def beta2_of(spec: str) -> Optional[float]:
    """The β2 of a spec ``BASE:b2=X`` (a Lion-family method with another momentum β2); None without one."""
    field_ = spec.partition(":")[2]
    if not field_.startswith("b2="):
        return None
    try:
        b2 = float(field_[3:])
    except ValueError:
        b2 = -1.0
    if not 0 <= b2 < 1:
        raise ValueError(f"b2 must be in [0, 1), got {spec!r}")
    return b2


def quant_bits_of(spec: str) -> Optional[int]:
    """The field width B of a spec ``lioncub_quant:bits=B`` (2, 4 or 8); None without one (8 bits)."""
    field_ = spec.partition(":")[2]
    if not field_.startswith("bits="):
        return None
    if field_[5:] not in ("2", "4", "8"):
        raise ValueError(f"bits must be 2, 4 or 8, got {spec!r}")
    return int(field_[5:])


def canonical(spec: str) -> str:
    """The spec with its parameter written out: ``"dgc"`` → ``"dgc:0.001"``."""
    base, arg = parse_method(spec)
    if base in LOCAL_METHODS:
        opts = local_options(spec)
        extra = "".join(f":{k}={opts[k]:g}" if isinstance(opts[k], float) else f":{k}={opts[k]}"
                        for k, default in LOCAL_OPTIONS[base].items() if opts[k] != default)
        return f"{base}:{arg}{extra}"
    if beta2_of(spec) is not None:
        return f"{base}:b2={beta2_of(spec):g}"
    if quant_bits_of(spec) is not None:
        return f"{base}:bits={quant_bits_of(spec)}"
    if arg is None:
        return base
    clip = dgc_clip(spec) if base == "dgc" else None
    return f"{base}:{arg:g}" + (f":clip={clip:g}" if clip is not None else "")


def family(spec: str) -> str:
    base = parse_method(spec)[0]
    if base == "dlocal_mavo":  # the vote's inner optimizer: Lion, or AdamW (``inner=adamw``)
        return local_options(spec)["inner"]
    return FAMILY[base]


def twin(spec: str) -> Optional[str]:
    """The every-step method whose tuned lr / weight decay a local-step spec takes by
    default: the one with its inner optimizer (G-AdamW for ``inner=adamw``); None for an
    every-step spec."""
    base = parse_method(spec)[0]
    if base not in LOCAL_TWIN:
        return None
    return "gadamw" if family(spec) == "adamw" else LOCAL_TWIN[base]


def label(spec: str, legacy: bool = False) -> str:
    """Legend text of a spec; ``legacy``: a record of the pre-audit DGC / GradDrop."""
    base, arg = parse_method(spec)
    text = LABELS[base]
    if base in LOCAL_METHODS:
        opts = local_options(spec)
        if opts.get("wire", "fp32") != "fp32":  # "DiLoCo (AdamW)" -> "DiLoCo (AdamW, fp4)", as the _bf16 methods
            text = text[:-1] + f", {opts['wire']})"
        text += f" H={arg}"
        if opts.get("alpha", 1.0) != 1.0:
            text += f", α={opts['alpha']:g}"
        if opts.get("ef", 1) == 0:
            text += ", no EF"
        if opts.get("ties", "zero") == "random":
            text += ", random ties"
        if opts.get("ab", 0.0):
            text += f", abstain below {opts['ab']:g}·S"
        if opts.get("ob1", 0.0):
            text += f", outer β=({opts['ob1']:g}, {opts['ob2']:g}){' soft' if opts['osoft'] else ''}"
        if opts.get("esc", 0):
            text += ", step mean|e|"
        if opts.get("vote", "mavo") == "avg":
            text = text.replace("MaVo", "Avg")
        elif opts.get("vote", "mavo") in L.VALUE_VOTES:
            text = text.replace("MaVo", {"mean": "mean (fp32)", "count": "count vote"}[opts["vote"]])
        if opts.get("inner", "lion") == "adamw":
            text = text.replace("D-Local", "D-Local (AdamW inner)")
        if opts.get("sw", 0):
            text += f", H={opts['h0']} for the first {opts['sw']} steps"
        if opts.get("mr", 0):
            text += ", momenta reset at each sync"
        if opts.get("st", 0):
            text += ", streamed" + (f" in {opts['fr']} fragments" if opts.get("fr", 1) > 1 else "")
            if opts.get("sd", -1) >= 0:
                text += f", applied {opts['sd']} steps on" if opts["sd"] else ", applied at once"
            if opts.get("ra", 0):
                text = text.replace("momenta reset at each sync", "momenta reset where each vote is applied")
            if opts.get("rs", 0):
                text += ", each round restarted from the anchor"
            if opts.get("kd", 1.0) != 1.0:
                text += f", {opts['kd']:g} of the progress during the delay kept"
            if opts.get("mix", 0.0):
                text += f", merged {opts['mix']:g} : {1 - opts['mix']:g} with the worker's parameters"
        if opts.get("outer_lr", 0.7) != 0.7:
            text += f", outer lr {opts['outer_lr']:g}"
        if opts.get("outer_momentum", 0.9) != 0.9:
            text += f", outer momentum {opts['outer_momentum']:g}"
        return text
    if base in ("dgc", "graddrop") and ":" in spec:
        text += f" {100 * arg:g} %"
        if base == "dgc" and dgc_clip(spec) is not None:
            text += f", clip {dgc_clip(spec):g}"
    elif beta2_of(spec) is not None:
        text += f", β2 = {beta2_of(spec):g}"
    elif quant_bits_of(spec) is not None:
        text = text.replace("8b", f"{quant_bits_of(spec)}b")
    elif base.startswith("powersgd") and ":" in spec:
        text = f"PowerSGD r={arg} + " + ("Lion" if base.endswith("lion") else "AdamW")
    if legacy and base in ("dgc", "graddrop"):
        text += " (pre-audit)"
    return text


def is_legacy(rec: dict) -> bool:
    return rec.get("bits_axis") != BITS_AXIS


def common_bits(rec: dict) -> float:
    """Bits one rank sends per parameter per step, for any record. Records of the old
    accounting (parameter-server up + down, no ``bits_axis``) are converted exactly from
    their stored counts: G-Lion / G-AdamW → 64·(N−1)/N; GradDrop / DGC (which uploaded
    64·k/d) → (N−1)·up (an all-gather); TernGrad (up = log2 3 + 32·T/d) → the
    :class:`~dlion.lab.experiments.baselines.TernGrad` count; D-Lion / Lion Cub were
    already bytes sent by one rank."""
    if not is_legacy(rec):
        return float(rec["bits"])
    base = parse_method(rec["method"])[0]
    N = rec["workers"]
    if base in ("glion", "gadamw"):
        return B.ring_allreduce_bits(1, 32, N)
    if base in ("graddrop", "dgc"):
        return min(B.allgather_bits(rec["bits_up"], N), B.ring_allreduce_bits(1, 32, N))
    if base == "terngrad":
        scales = rec["bits_up"] - math.log2(3)  # 32·T/d
        onebit = B.alltoall_bits(B.TRIT_BITS, N) + B.alltoall_bits(B.bits_for(2 * N + 1), N)
        return B.ring_allreduce_bits(scales / 32, 32, N) + min(onebit, B.allgather_bits(B.TRIT_BITS, N))
    return float(rec["bits"])


# Short per-family grids (lr × weight decay) searched by --tune at one N. To fit the
# compute budget only the lr is searched; the weight decay is fixed per family.
GRIDS = {
    "mnist1d": {"lion": {"lr": [1e-3, 3e-3, 1e-2, 3e-2], "weight_decay": [0.1]},
                "adamw": {"lr": [3e-3, 1e-2, 3e-2, 1e-1], "weight_decay": [0.01]},
                "sgdm": {"lr": [0.03, 0.1, 0.3, 1.0], "weight_decay": [0.0]}},
    "digits": {"lion": {"lr": [1e-3, 3e-3, 1e-2, 3e-2], "weight_decay": [0.1]},
               "adamw": {"lr": [3e-3, 1e-2, 3e-2, 1e-1], "weight_decay": [0.01]},
               "sgdm": {"lr": [0.03, 0.1, 0.3, 1.0], "weight_decay": [0.0]}},
    "shakespeare": {"lion": {"lr": [1e-3, 3e-3, 1e-2, 3e-2], "weight_decay": [0.1]},
                    "adamw": {"lr": [1e-2, 3e-2, 1e-1], "weight_decay": [0.1]},
                    "sgdm": {"lr": [0.01, 0.03, 0.1, 0.3, 1.0], "weight_decay": [0.0]}},
    # every family gets the same width: three values a factor √10 apart (extended past an edge
    # with `--tune --lrs` where the best landed there; docs/results.md says where)
    "charlm": {"lion": {"lr": [3e-5, 1e-4, 3e-4], "weight_decay": [0.1]},
               "adamw": {"lr": [3e-4, 1e-3, 3e-3], "weight_decay": [0.1]},
               "sgdm": {"lr": [0.03, 0.1, 0.3], "weight_decay": [0.0]}},
}
# Used when no tuned config is given: the middle of each grid.
DEFAULTS = {task: {fam: {"lr": g["lr"][len(g["lr"]) // 2], "weight_decay": g["weight_decay"][0]}
                   for fam, g in grids.items()} for task, grids in GRIDS.items()}
BETAS = {"mnist1d": {"lion": (0.9, 0.99), "adamw": (0.9, 0.999)},
         "digits": {"lion": (0.9, 0.99), "adamw": (0.9, 0.999)},
         "shakespeare": {"lion": (0.95, 0.98), "adamw": (0.9, 0.99)},
         "charlm": {"lion": (0.95, 0.98), "adamw": (0.9, 0.99)}}


class GlobalMethod:
    """An aggregator from :mod:`baselines` followed by a global optimizer."""

    def __init__(self, spec, params, world_size, hp, betas, seed, total_steps):
        self.params = params
        name, arg = parse_method(spec)
        shapes = [p.shape for p in params]
        lr, wd = hp["lr"], hp["weight_decay"]
        self.base_lr = lr
        self.step_count = 0
        if name in ("glion", "gadamw"):
            self.agg = B.MeanFP32(shapes, world_size)
        elif name == "terngrad":
            self.agg = B.TernGrad(shapes, world_size, seed=seed)
        elif name == "graddrop":
            self.agg = B.GradDrop(shapes, world_size, density=arg)
        elif name == "dgc":
            self.agg = B.DGC(shapes, world_size, density=arg, momentum=0.9, warmup_steps=max(1, total_steps // 10),
                             clip_norm=dgc_clip(spec))
        elif name.startswith("powersgd"):
            self.agg = B.PowerSGD(shapes, world_size, rank=arg, random_seed=seed)
        else:
            raise ValueError(spec)
        if name in ("glion", "powersgd_lion"):
            self.opt = Lion(params, lr=lr, betas=betas["lion"], weight_decay=wd)
        elif name in ("gadamw", "graddrop", "powersgd_adamw"):
            self.opt = torch.optim.AdamW(params, lr=lr, betas=betas["adamw"], weight_decay=wd)
        elif name == "terngrad":
            self.opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd)
        else:  # dgc: the momentum lives in the aggregator
            self.opt = B.DGCSGD(params, lr=lr, momentum=0.9, weight_decay=wd)

    def step(self, grads, lr_factor: float = 1.0):
        agg = self.agg(grads)
        if isinstance(self.agg, B.DGC):
            lr_factor *= self.agg.lr_factor(self.step_count)
        for group in self.opt.param_groups:
            group["lr"] = self.base_lr * lr_factor
        for p, g in zip(self.params, agg):
            p.grad = g.to(p.dtype)
        self.opt.step()
        for p in self.params:
            p.grad = None
        self.step_count += 1

    def bits(self) -> dict:
        return {"bits": self.agg.bits.per_param_per_step(), "bits_by_collective": self.agg.bits.breakdown(),
                "bits_axis": BITS_AXIS, "bits_source": "counted (formula)"}


def dlion_options(spec: str) -> dict:
    """The options of :class:`dlion.DistributedLion` (and of its simulated twin) for a D-Lion / Lion Cub method."""
    name = parse_method(spec)[0]
    kw = dict(vote="mavo", comm="1bit")
    if name == "dlion_avg":
        kw["vote"] = "avg"
    elif name == "dlion_mavo_rties":
        kw["ties"] = "random"
    elif name == "lioncub_quant":
        kw.update(aggregate="quantized", quant_norm="l1", quant_bits=quant_bits_of(spec) or 8)
    elif name == "lioncub_msync":
        kw.update(momentum_sync=MOMENTUM_SYNC_K)
    elif name != "dlion_mavo":
        raise ValueError(name)
    return kw


class SimMethod:
    """D-Lion / Lion Cub through :class:`SimulatedDistributedLion`."""

    def __init__(self, spec, params, world_size, hp, betas, seed):
        self.sim = SimulatedDistributedLion(params, world_size, lr=hp["lr"], betas=betas["lion"],
                                            weight_decay=hp["weight_decay"], seed=seed, **dlion_options(spec))
        self.world_size = world_size
        self.base_lr = hp["lr"]
        self._tally = (0, 0, 0)

    def step(self, grads, lr_factor: float = 1.0):
        self.sim.lr = self.base_lr * lr_factor
        self.sim.step([[g[i] for g in grads] for i in range(self.world_size)])

    def vote_agreement(self) -> Optional[list]:
        """[unanimous, tied] fractions of the voted coordinates since the last call (None
        for the quantised aggregation, whose vote is over integers, not signs)."""
        cs = self.sim.comm_stats
        now = (cs.voted, cs.unanimous, cs.tied)
        d = [a - b for a, b in zip(now, self._tally)]
        self._tally = now
        return [d[1] / d[0], d[2] / d[0]] if d[0] and self.sim.aggregate == "sign" else None

    def bits(self) -> dict:
        cs, d = self.sim.comm_stats, self.sim.num_params
        sent = 8.0 * cs.bytes_sent / (d * cs.steps) if cs.steps else 0.0
        return {"bits": sent, "bits_sent_plus_received": cs.bits_per_param_per_step(d),
                "bits_by_kind": {k: 8.0 * v[0] / (d * cs.steps) for k, v in cs.by_kind.items()} if cs.steps else {},
                "bits_axis": BITS_AXIS, "bits_source": "counted (wire format)"}


def make_method(spec, params, world_size, hp, task_name, seed, total_steps):
    betas = BETAS[task_name]
    if beta2_of(spec) is not None:
        betas = dict(betas, lion=(betas["lion"][0], beta2_of(spec)))
    name = parse_method(spec)[0]
    if name in LOCAL_METHODS:
        o = local_options(spec)
        if name == "dlocal_mavo":
            return L.LocalVote(params, world_size, o["H"], hp, betas, seed, total_steps, alpha=o["alpha"],
                               error_feedback=bool(o["ef"]), ties=o["ties"], outer_betas=(o["ob1"], o["ob2"]),
                               abstain_below=o["ab"], error_scale=bool(o["esc"]), soft_outer=bool(o["osoft"]),
                               vote=o["vote"], warmup_steps=o["sw"], warmup_H=o["h0"], momentum_reset=bool(o["mr"]),
                               streaming=bool(o["st"]), fragments=o["fr"], bucket_mb=o["bmb"],
                               stream_delay=None if o["sd"] < 0 else o["sd"], keep_delay=o["kd"],
                               restart=bool(o["rs"]), mix=o["mix"],
                               reset_at_apply=bool(o["ra"]), inner=o["inner"])
        return L.DiLoCo(params, world_size, o["H"], hp, betas, seed, total_steps,
                        inner="adamw" if "adamw" in name else "lion", bf16=name.endswith("_bf16"),
                        outer_lr=o["outer_lr"], outer_momentum=o["outer_momentum"], wire=o.get("wire"))
    if name.startswith(("dlion", "lioncub")):
        return SimMethod(spec, params, world_size, hp, betas, seed)
    return GlobalMethod(spec, params, world_size, hp, betas, seed, total_steps)


def total_steps(task: Task, world_size: int, budget: int) -> int:
    return budget


def run_key(task: str, method: str, world_size: int, seed: int, budget: int, hp: dict, tune: bool = False) -> str:
    h = json.dumps({"lr": hp["lr"], "wd": hp["weight_decay"]}, sort_keys=True)
    return f"{task}|{'tune|' if tune else ''}{method}|N={world_size}|seed={seed}|budget={budget}|{h}"


def run_one(task_name: str, method: str, world_size: int, seed: int, budget: int, hp: dict,
            tune: bool = False) -> dict:
    """Train one model with ``world_size`` simulated workers; return the record."""
    method = canonical(method)
    task = make_task(task_name, tune)
    model = task.make_model(seed)
    params = list(model.parameters())
    steps = total_steps(task, world_size, budget)
    m = make_method(method, params, world_size, hp, task_name, seed, steps)
    points = task.eval_points(budget, world_size)
    curve, train_loss, losses = [], [], []
    t0 = time.time()
    diverged = False
    pi = 0
    step = 0
    agreement = []
    local = getattr(m, "local", False)  # own parameters per worker: gradients at each worker's copy
    for x, y, progress in task.batches(world_size, seed, budget):
        grads, loss = task.per_worker_grads(model, x, y, m.worker_params if local else None)
        m.step(grads, task.lr_factor(step, steps))
        step += 1
        losses.append(loss)
        if not math.isfinite(loss) or not all(torch.isfinite(p).all() for p in params):
            diverged = True
        if pi < len(points) and progress >= points[pi] - 1e-9:
            metric = task.evaluate(model) if not diverged else float("nan")
            curve.append([task.epoch_of(points[pi], world_size), metric, points[pi]])
            train_loss.append([points[pi], sum(losses) / len(losses)])
            losses = []
            if hasattr(m, "vote_agreement"):
                agreement.append([points[pi], m.vote_agreement()])
            pi += 1
        if diverged:
            break
    final = curve[-1][1] if curve and not diverged else float("nan")
    rec = {"key": run_key(task_name, method, world_size, seed, budget, hp, tune), "task": task_name,
           "tune": tune, "method": method, "workers": world_size, "seed": seed, "budget": budget,
           "budget_unit": task.budget_unit, "steps": step, "local_batch": task.local_batch,
           "lr": hp["lr"], "weight_decay": hp["weight_decay"], "metric": task.metric,
           "final": final, "diverged": diverged, "curve": curve, "train_loss": train_loss,
           "num_params": sum(p.numel() for p in params), "seconds": round(time.time() - t0, 2),
           "impl": IMPL, "schedule": task.schedule}
    if task.schedule != "constant":
        rec.update(warmup_frac=task.warmup_frac, final_lr_frac=task.final_lr_frac)
    if any(a[1] is not None for a in agreement):
        # the vote's agreement between evaluations: fractions of the voted coordinates on
        # which all N workers' signs agreed, and on which they cancelled (a tie)
        rec["vote_agreement"] = [[p, a[0], a[1]] for p, a in agreement if a is not None]
    rec.update(m.bits())
    if local:  # H, syncs, options; the evaluated model is the anchor (local_steps.py)
        rec["local_steps"] = m.record()
    return rec


def _real_rank(rank: int, world_size: int, task_name: str, method: str, seed: int, budget: int, hp: dict,
               stop_after: int) -> dict:
    """One rank of :func:`run_real`: its own worker's batches, plain autograd, DistributedLion."""
    from torch.func import functional_call, grad

    from dlion.distributed import DistributedLion

    from .tasks import plain_attention

    task = make_task(task_name)
    model = task.make_model(seed)
    opt = DistributedLion(model.named_parameters(), lr=hp["lr"], betas=BETAS[task_name]["lion"],
                          weight_decay=hp["weight_decay"], seed=seed, **dlion_options(method))
    points = task.eval_points(budget, world_size)
    curve, step, t0 = [], 0, time.time()

    def loss_fn(p, xb, yb):
        return functional_call(model, p, (xb, yb))[1]

    for x, y, progress in task.batches(world_size, seed, budget):
        if step >= stop_after:
            break
        params = {n: p.detach() for n, p in model.named_parameters()}
        with plain_attention():  # the attention of the simulated path, for the same rounding
            g = grad(loss_fn)(params, x[rank], y[rank])
        for n, p in model.named_parameters():
            p.grad = g[n]
        for group in opt.param_groups:
            group["lr"] = hp["lr"] * task.lr_factor(step, budget)
        opt.step()
        opt.zero_grad()
        step += 1
        if points and progress >= points[0] - 1e-9:
            points.pop(0)
            curve.append([progress, task.evaluate(model) if rank == 0 else None, progress])
    digest = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"curve": curve, "steps": step, "seconds": round(time.time() - t0, 2),
            "params": digest}


def run_real(task_name: str, method: str, world_size: int, seed: int, budget: int, hp: dict,
             stop_after: Optional[int] = None, keep_params: bool = False) -> dict:
    """Train a D-Lion / Lion Cub method on ``world_size`` real Gloo ranks (one process each,
    :class:`dlion.DistributedLion`), with the data, schedule and seeds of :func:`run_one`, for
    the first ``stop_after`` steps of the ``budget`` schedule. Returns the record with rank 0's
    validation curve and whether every rank ended with bitwise equal parameters (and, with
    ``keep_params``, rank 0's final parameters flattened under ``"params"``)."""
    from ..spawn import spawn

    method = canonical(method)
    if not isinstance(make_task(task_name), ShakespeareTask):
        raise ValueError(f"the real multi-rank path runs the language-model tasks, not {task_name!r}")
    if not parse_method(method)[0].startswith(("dlion", "lioncub")):
        raise ValueError(f"the real multi-rank path runs D-Lion / Lion Cub methods, not {method!r}")
    stop_after = budget if stop_after is None else min(stop_after, budget)
    outs = spawn(_real_rank, world_size, task_name, method, seed, budget, hp, stop_after,
                 timeout_s=3600.0)
    same = all(torch.equal(outs[0]["params"], o["params"]) for o in outs[1:])
    rec = {"key": run_key(task_name, method, world_size, seed, budget, hp), "task": task_name,
            "method": method, "workers": world_size, "seed": seed, "budget": budget, "steps": outs[0]["steps"],
            "lr": hp["lr"], "weight_decay": hp["weight_decay"], "curve": outs[0]["curve"],
            "ranks_bitwise_equal": same, "seconds": outs[0]["seconds"], "path": "real Gloo ranks"}
    if keep_params:
        rec["params"] = outs[0]["params"]
    return rec


def load_runs(path: str) -> list[dict]:
    """Records of a JSONL results file; a torn last line (interrupted write) is ignored."""
    runs = []
    if not os.path.exists(path):
        return runs
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return runs


def repair(path: str) -> None:
    """Cut a torn last line (a run killed while its record was being written), so
    that the next record starts on a line of its own."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


def _append(path: str, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def hparams_for(config: Optional[dict], task: str, method: str) -> dict:
    """The lr and weight decay ``config`` gives ``method``: its own entry (a spec written with its defaults
    spelled out matches), else a local-step method's every-step twin's (``glion`` / ``gadamw``), else the
    task's defaults. An entry that is no spec raises (a typo would otherwise fall back in silence); a fall
    back to the twin while the config names other specs of the same base warns."""
    methods = dict((config or {}).get("methods", {}))
    for k in list(methods):  # a config may spell a spec with its defaults (":alpha=1"): match it written out
        try:
            methods.setdefault(canonical(k), methods[k])
        except ValueError as e:
            raise ValueError(f"the config names {k!r}, which is no method spec: {e}") from None
    # a local-step method falls back on the every-step method of its inner optimizer
    for key in [method, canonical(method)] + [k for k in (twin(method),) if k]:
        if key in methods:
            if key == twin(method):
                near = sorted(k for k in methods if k.split(":")[0] == method.split(":")[0] and k != key)
                if near:
                    warnings.warn(f"{method!r} is not in the config; it takes {key!r}'s lr, though the config names "
                                  f"{', '.join(near)}", stacklevel=2)
            c = methods[key]
            return {"lr": c["lr"], "weight_decay": c["weight_decay"]}
    return dict(DEFAULTS[task][family(method)])


def _progress(total, desc, quiet):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=quiet, dynamic_ncols=True, mininterval=1.0)


def sweep(task: str, methods, workers, seeds, budget: int, runs_path: str, config: Optional[dict] = None,
          quiet: bool = False, max_runs: Optional[int] = None) -> list[dict]:
    """Run every (method, N, seed) not already in ``runs_path``; append each finished
    run to it at once. Returns all records of this sweep (old and new)."""
    repair(runs_path)
    done = {r["key"]: r for r in load_runs(runs_path)}
    jobs = []
    for seed in seeds:
        for n in workers:
            for method in map(canonical, methods):
                hp = hparams_for(config, task, method)
                jobs.append((method, n, seed, hp, run_key(task, method, n, seed, budget, hp)))
    todo = [j for j in jobs if j[4] not in done]
    bar = _progress(len(jobs), f"{task} sweep", quiet)
    bar.update(len(jobs) - len(todo))
    ran = 0
    for method, n, seed, hp, key in todo:
        if max_runs is not None and ran >= max_runs:
            break
        bar.set_postfix_str(f"{method} N={n} seed={seed}")
        rec = run_one(task, method, n, seed, budget, hp)
        _append(runs_path, rec)
        done[key] = rec
        ran += 1
        bar.update(1)
    bar.close()
    return [done[j[4]] for j in jobs if j[4] in done]


def tune(task: str, methods, world_size: int, seed: int, budget: int, runs_path: str,
         quiet: bool = False, lrs=None) -> dict:
    """Grid search per method at one N on a held-out part of the training data;
    returns the config ``{"methods": {method: {lr, weight_decay, score, grid}}}``.
    ``lrs`` replaces the family grid's learning rates.
    Runs are appended to ``runs_path`` and skipped when already there (resumable)."""
    from itertools import product

    repair(runs_path)
    done = {r["key"]: r for r in load_runs(runs_path)}
    jobs = []
    methods = [canonical(m) for m in methods]
    for method in methods:
        g = GRIDS[task][family(method)]
        for lr, wd in product(lrs or g["lr"], g["weight_decay"]):
            hp = {"lr": lr, "weight_decay": wd}
            jobs.append((method, hp, run_key(task, method, world_size, seed, budget, hp, tune=True)))
    bar = _progress(len(jobs), f"{task} tune N={world_size}", quiet)
    bar.update(sum(j[2] in done for j in jobs))
    for method, hp, key in jobs:
        if key in done:
            continue
        bar.set_postfix_str(f"{method} lr={hp['lr']:g} wd={hp['weight_decay']:g}")
        rec = run_one(task, method, world_size, seed, budget, hp, tune=True)
        _append(runs_path, rec)
        done[key] = rec
        bar.update(1)
    bar.close()
    higher = make_task(task, True).higher_is_better
    config = {"task": task, "tuned_at_workers": world_size, "tune_seed": seed, "budget": budget,
              "selection": "best mean of the last 3 evaluations on held-out training data", "methods": {}}
    for method in methods:
        rows = []
        for m, hp, key in jobs:
            if m != method:
                continue
            r = done[key]
            tail = [c[1] for c in r["curve"][-3:]]
            score = sum(tail) / len(tail) if tail and not r["diverged"] else float("nan")
            rows.append({"lr": hp["lr"], "weight_decay": hp["weight_decay"], "score": score})
        ok = [r for r in rows if math.isfinite(r["score"])]
        best = (max if higher else min)(ok, key=lambda r: r["score"]) if ok else dict(
            DEFAULTS[task][family(method)], score=float("nan"))
        config["methods"][method] = {"lr": best["lr"], "weight_decay": best["weight_decay"],
                                     "score": best["score"], "grid": rows}
    return config
