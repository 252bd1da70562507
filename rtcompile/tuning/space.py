"""The tuner's search space: form first, then only that form's fields.

A trial draws ``form`` among the kernel's forms that can run the bucket's shape
(``forms.KERNELS``: a form whose ``space(shape)`` is empty cannot), then that form's fields,
each as the parameter ``FORM.FIELD`` with the choices of ``space(shape)``: Optuna's
define-by-run (conditional) search space, so a field exists only in the trials of its form and
no gating table is needed. A sub-space holds ``form`` and/or ``FORM.FIELD`` at one value
(``TuneOptions.fixed``, ``rtcompile tune --fix``).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from ..kernels.chunk_backward import shape_refusal
from ..kernels.config import DEFAULT_SMEM_BYTES, KernelConfig, KernelShape
from ..kernels.forms import FORMS, KERNELS, candidates, iter_space
from .keys import Bucket

INPUT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def bucket_shape(bucket: Bucket) -> KernelShape:
    return KernelShape(bucket.key_widths, bucket.value_width, INPUT_BYTES[bucket.dtype])


def bucket_decode_rows(bucket: Bucket) -> int | None:
    """Sequences x heads of a decode bucket, on which its default tile depends
    (:func:`~rtcompile.kernels.forms.decode_tile`); None for the other kernels. The bucket's
    batch (a power of two) is what its trials run, so its default is that batch's: a call of a
    batch between buckets may default to the other tile (B96 at K 256 H8: 768 rows, narrow)."""
    return bucket.batch * bucket.heads if bucket.kernel == "recurrent" else None


def smem_limit(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).shared_memory_per_block_optin
    return DEFAULT_SMEM_BYTES


def device_refusal(cfg: KernelConfig, device) -> str | None:
    """Why ``cfg`` cannot run on the tuning device (a name or a torch.device) beyond its own check
    (the Gluon state loop off sm_90, ``launch.device_refusal``); None when it can. Such a trial is
    pruned, never run."""
    import torch

    from ..kernels.launch import device_refusal as refused

    return refused(cfg, torch.device(device))


# combinations of a form's fields looked at for one the device does not refuse (its own check
# aside): the last field varies fastest, so a free field the device cares about flips within a
# few (the split form's loop every other one, its tma after 288 at o3 16x16)
RUNNABLE_PROBE = 4096


def device_refusal_of_space(bucket: Bucket, opts) -> str | None:
    """Why the tuning device refuses every config of the bucket's (sub-)space (the reason of the
    first), or None when some combination of up to RUNNABLE_PROBE per form is not refused by it.
    A sub-space fixed to what the device refuses (``--fix split.loop=gluon`` off sm_90) would
    otherwise prune every trial and report the default, which lies outside it, as its best.
    Only ``device_refusal`` is asked, not each config's own check (at o3 16x16 the first 512 valid
    configs with the Gluon loop took 1.6 M checks, 14 s on the CPU machine)."""
    import torch

    first, dev = None, torch.device(opts.device)
    for form, space in search_space(bucket, opts).items():
        names = list(space)
        for values in itertools.islice(itertools.product(*(space[n] for n in names)), RUNNABLE_PROBE):
            if (reason := device_refusal(FORMS[form](**dict(zip(names, values))), dev)) is None:
                return None
            first = first or reason
    return first


def refusal(bucket: Bucket) -> str | None:
    """Why no config of the bucket's kernel can run its shape (the backward's own reason,
    ``chunk_backward.shape_refusal``, for a train bucket), or None."""
    shape = bucket_shape(bucket)
    if bucket.kernel == "chunk_bwd" and (reason := shape_refusal(shape)) is not None:
        return f"the train tuner cannot tune {bucket.label}: {reason}"
    if not any(cls.space(shape) for cls in KERNELS[bucket.kernel]):
        return f"no form of the {bucket.kernel} kernel can run K={shape.key_dim}, d_v={shape.value_width}"
    return None


def search_space(bucket: Bucket, opts) -> dict[str, dict[str, list]]:
    """form -> field -> choices: the kernel's forms that can run the bucket's shape (a non-empty
    ``space``), each with its declared space, ``opts.fixed`` applied. ``fixed`` names
    ``form`` or ``FORM.FIELD``; anything else, a form of another kernel or one that cannot run
    the shape, a field the form does not have, or a value its space does not hold is a
    ValueError naming what is allowed; so is a bucket no form can run (:func:`refusal`)."""
    if (reason := refusal(bucket)) is not None:
        raise ValueError(reason)
    shape = bucket_shape(bucket)
    space = {cls.form: dict(sp) for cls in KERNELS[bucket.kernel] if (sp := cls.space(shape))}
    forms = ", ".join(space)
    fixed = dict(opts.fixed)
    if "form" in fixed:
        form = fixed.pop("form")
        if form not in space:
            mine = form in (cls.form for cls in KERNELS[bucket.kernel])
            why = "cannot run this shape" if mine else f"is not a form of the {bucket.kernel} kernel"
            raise ValueError(f"fixed form={form!r} {why}; allowed forms for the {bucket.kernel} kernel at "
                             f"K={shape.key_dim}, d_v={shape.value_width}: {forms}")
        space = {form: space[form]}
    for key, value in fixed.items():
        form, dot, name = key.partition(".")
        if not dot or not name:
            raise ValueError(f"fixed parameter {key!r}: give form=NAME or FORM.FIELD=VALUE; forms of the "
                             f"{bucket.kernel} kernel here: {forms}")
        if form not in space:
            if "form" in opts.fixed:
                why = f"the form is fixed to {opts.fixed['form']!r}"
            elif form in (cls.form for cls in KERNELS[bucket.kernel]):
                why = "that form cannot run this shape"
            else:
                why = f"{form!r} is not a form of the {bucket.kernel} kernel"
            raise ValueError(f"fixed parameter {key!r}: {why}; allowed forms: {', '.join(space)}")
        if name not in space[form]:
            raise ValueError(f"fixed parameter {key!r}: the {form} form has {', '.join(space[form])}")
        if value not in space[form][name]:
            raise ValueError(f"fixed {key}={value!r}: allowed values for this shape are "
                             f"{', '.join(map(str, space[form][name]))}")
        space[form][name] = [value]
    return space


def config_params(config: KernelConfig) -> dict[str, Any]:
    """A config as a trial's parameters: ``form`` and ``FORM.FIELD`` for each field."""
    return {"form": config.form, **{f"{config.form}.{k}": v for k, v in config.to_dict().items() if k != "form"}}


def in_subspace(config: KernelConfig, fixed: dict[str, Any]) -> bool:
    """Does ``config`` lie in the sub-space ``fixed`` (``TuneOptions.fixed``) names: its form
    the fixed one, and each ``FORM.FIELD`` of its own form at the fixed value (a field of
    another form does not constrain it)."""
    params = config_params(config)
    return all(params.get(key) == value for key, value in fixed.items()
               if key == "form" or key.split(".", 1)[0] == config.form)


def params_config(params: dict[str, Any]) -> KernelConfig:
    """The config a trial's parameters describe (:func:`config_params` inverted)."""
    form = params["form"]
    prefix = f"{form}."
    return FORMS[form](**{k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)})


def exhaustive_variants(bucket: Bucket, opts) -> list[KernelConfig]:
    """Every config of the (sub-)space that passes ``check`` and runs on this device: form by form, each
    in its space's order (``forms.iter_space``). The sweep enqueues exactly these as WAITING
    trials rather than using Optuna's BruteForceSampler: that sampler draws at ``ask`` time and
    walks the whole product, refused combinations included (at o3 16x16 bf16 the split form's
    space is 393,660 combinations, 286,740 valid on an H200), while the sweep's count relies on
    a fixed set of enqueued trials that any number of workers, on any number of hosts, claim."""
    import torch

    shape, limit, dev = bucket_shape(bucket), smem_limit(opts.device), torch.device(opts.device)
    found = (cfg for form, space in search_space(bucket, opts).items()
             for cfg in iter_space(FORMS[form], shape, space, limit) if device_refusal(cfg, dev) is None)
    return distinct(found)


def distinct(configs) -> list[KernelConfig]:
    """The first of each set of ``configs`` that differ in inert fields only
    (``KernelConfig.canonical``: at o3 16x16 every phi_pass config came in three key groups), in
    order; a config keeps its own fields (a fixed inert field keeps its fixed value)."""
    seen, out = set(), []
    for cfg in configs:
        if (key := cfg.canonical()) not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def suggest(trial, space: dict[str, dict[str, list]]) -> KernelConfig:
    """A trial's config: the form first, then that form's fields only (Optuna's conditional
    search space), so no field is drawn beside a form that does not have it. Sampled over one
    flat space instead, the split form's output-kernel fields beside another form would have
    left 1 in 72 of those draws valid."""
    form = trial.suggest_categorical("form", list(space))
    fields = {n: trial.suggest_categorical(f"{form}.{n}", choices) for n, choices in space[form].items()}
    return FORMS[form](**fields)


def _in_space(params: dict[str, Any], space: dict[str, dict[str, list]]) -> bool:
    form = params["form"]
    return form in space and all(params.get(f"{form}.{n}") in choices for n, choices in space[form].items())


def warm_starts(bucket: Bucket, opts, budget: int | None) -> list[dict]:
    """The parameters of the kernel's default candidates (``forms.candidates``, best first, with
    ``opts.fixed`` applied; invalid and repeated ones and those outside the sub-space dropped),
    at most a quarter of ``budget`` (all of them when None) and at least the default; then, with a
    budget, the first one's one-field neighbours (:func:`neighbours`) up to half of it. A TPE
    study runs them first, so its best is never worse than the default and TPE's model starts
    from measured good points instead of random draws alone: on the H200 sweep of 2026-11-30
    (o3 16x16 prefill, 127 valid variants) only one variant was within 3% of the best, a needle
    that 25 random-then-TPE picks rarely hit. The neighbours: Optuna's TPE draws its first 10
    trials at random, so a study of 10-20 trials is mostly random search; on the H200 sweep of
    o2 64's split form with the loop free (48 configs, B1 T4096, 2026-12-04; 3 within 3% of the
    best, one field from the default) 100 replayed 10-trial studies reached 3% in 44% with the
    candidates alone and 68% with the neighbours (replayed on the data that suggested them)."""
    shape, limit = bucket_shape(bucket), smem_limit(opts.device)
    space = search_space(bucket, opts)
    out: list[dict] = []
    seen = set()  # canonical configs of ``out``
    for cfg in candidates(bucket.kernel, shape, limit, decode_rows=bucket_decode_rows(bucket)):
        params = {**config_params(cfg), **{k: v for k, v in opts.fixed.items() if k.startswith(f"{cfg.form}.")}}
        chosen = params_config(params)
        if _in_space(params, space) and chosen.check(shape, limit) is None and chosen.canonical() not in seen:
            seen.add(chosen.canonical())
            out.append(params)
    if budget is None:
        return out
    out = out[: max(1, budget // 4)]
    return out + neighbours(out[0], space, bucket, opts, budget // 2 - len(out), exclude=out) if out else out


def neighbours(params: dict, space: dict[str, dict[str, list]], bucket: Bucket, opts, count: int,
               exclude: list[dict] = ()) -> list[dict]:
    """Up to ``count`` configs of ``space`` (the bucket's :func:`search_space`) that differ from
    ``params`` in one field, valid for the bucket's shape and runnable on the tuning device, none
    of ``exclude``, in an order shuffled by ``opts.seed`` (so a study repeats its draws)."""
    if count <= 0:
        return []
    import torch

    shape, limit, dev = bucket_shape(bucket), smem_limit(opts.device), torch.device(opts.device)
    form = params["form"]
    found, seen = [], {params_config(p).canonical() for p in (params, *exclude)}
    for name, choices in space.get(form, {}).items():
        for value in choices:
            other = {**params, f"{form}.{name}": value}
            cfg = params_config(other)
            if cfg.canonical() in seen:  # the same config, or one an inert field alone tells apart
                continue
            if cfg.check(shape, limit) is None and device_refusal(cfg, dev) is None:
                found.append(other)
                seen.add(cfg.canonical())
    random.Random(opts.seed).shuffle(found)
    return found[:count]
