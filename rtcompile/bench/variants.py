"""The named configs the bench times beside each default (``rtcompile[name]`` rows): functions of
a case returning the launcher's keyword arguments, or NotImplementedError (the row then reads
``refused: <reason>``) where the variant cannot run the case's shape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .core import Case


def _case_shape(case: "Case") -> tuple[Any, int]:
    """The case's KernelShape (its own input width: the defaults' product precision depends on
    it; 2026-11-30f's error cases built the named variants for bf16 and ran them on fp32 inputs
    too, fp32 error 2.5e-3 against 7.9e-7 for the default) and this GPU's shared memory."""
    import torch

    from ..kernels.config import KernelShape

    shape = KernelShape(tuple(case.key_widths), case.V, getattr(torch, case.dtype).itemsize)
    return shape, torch.cuda.get_device_properties(0).shared_memory_per_block_optin


def _checked(config: Any, shape: Any, limit: int) -> dict[str, Any]:
    """``{"variant": config}``, or NotImplementedError (the row reads ``refused: <reason>``)."""
    reason = config.check(shape, limit)
    if reason is not None:
        raise NotImplementedError(reason)
    return {"variant": config}


def _default_with(kernel: str = "chunk", **changes: Any) -> Callable[["Case"], dict[str, Any]]:
    """A function of the case: its default config of ``kernel`` ("chunk" or "recurrent") with
    ``changes``; refused where the result cannot run the shape. The recurrent default is the
    case's batch's (:func:`~rtcompile.kernels.forms.decode_tile` at T = 1), so the row differs
    from the default row in ``changes`` alone."""
    def variant(case: "Case") -> dict[str, Any]:
        import dataclasses

        from ..kernels import forms

        shape, limit = _case_shape(case)
        rows = case.B * case.H if kernel == "recurrent" and case.T == 1 else None
        base = forms.default_config(kernel, shape, limit, decode_rows=rows)
        return _checked(dataclasses.replace(base, **changes), shape, limit)

    return variant


def _from_forms(pick: str, refusal: str) -> Callable[["Case"], dict[str, Any]]:
    """A function of the case: ``forms.<pick>(shape, limit)`` checked, refused with ``refusal``
    where it gives None."""
    def variant(case: "Case") -> dict[str, Any]:
        from ..kernels import forms

        shape, limit = _case_shape(case)
        config = getattr(forms, pick)(shape, limit)
        if config is None:
            raise NotImplementedError(refusal)
        return _checked(config, shape, limit)

    return variant


# forms.two_kernel: the first candidate of the case's defaults that is not the split form
_two_kernel = _from_forms("two_kernel", "the default is not the split form (it is a two-kernel config already)")
# forms.split_form: the split form where the default is another form (K <= 128 at order 2 and 3;
# the register estimate refuses it at o2 256)
_split_form = _from_forms("split_form", "the default is the split form, or the split form cannot run this shape")


def _materialise(case: "Case") -> dict[str, Any]:
    """The first materialised proposal of the defaults table that runs the shape (phi(q), phi(k)
    formed, order 2's configs on them; forms' last row): order >= 3 up to K = 256, refused
    elsewhere."""
    from ..kernels import forms

    shape, limit = _case_shape(case)
    found = [c for c in forms.candidates("chunk", shape, limit) if getattr(c, "materialise", False)]
    if not found:
        raise NotImplementedError("no materialise=True proposal runs this shape (order >= 3, K <= 256 only)")
    return _checked(found[0], shape, limit)


def _fused(case: "Case") -> dict[str, Any]:
    """``forms.low_memory``: the default's fused sibling (no workspace that grows with T)."""
    from ..kernels import forms

    shape, limit = _case_shape(case)
    return _checked(forms.low_memory(shape, limit), shape, limit)


# the named variants whose error the error cases report (all of them)
ERROR_VARIANTS = ("fused", "two-kernel", "split", "materialise")

# Named extra implementations timed beside the default: name -> kwargs, or a function of the
# case returning kwargs (for configs that depend on the shape). "two-kernel": where the default
# is the split form (K = 256 at order >= 3), the best two-kernel config, whose workspace is ~9x
# smaller (the planner's choice where only that fits). "fused": no prepare kernel and no [T, C]
# workspace, so its extra memory does not grow with T (the planner's low-memory choice).
# "split": the split form where the default is another form, "materialise": phi materialised
# (order >= 3, K <= 256), both beside fla at K <= 256 (issue 22: never slower than fla).
DEFAULT_VARIANTS: dict[str, Any] = {
    "two-kernel": _two_kernel,
    "fused": _fused,
    "split": _split_form,
    "materialise": _materialise,
}


def _batch_free(case: "Case") -> dict[str, Any]:
    """The decode default of the shape alone (no :func:`~rtcompile.kernels.forms.decode_tile`:
    the tile before the batch rule), refused where the batch's default is that tile."""
    from ..kernels import forms

    shape, limit = _case_shape(case)
    tile = forms.default_config("recurrent", shape, limit)
    if tile == forms.default_config("recurrent", shape, limit, decode_rows=case.B * case.H):
        raise NotImplementedError("the default at this batch (no doubled tile)")
    return _checked(tile, shape, limit)


# Decode beside its default (phi gathered per element): the slab held factored, phi broadcast
# from the factors (outer_phi; power-of-two widths); the tile the batch rule doubled.
DECODE_VARIANTS: dict[str, Any] = {
    "outer-phi": _default_with("recurrent", outer_phi=True),
    "batch-free": _batch_free,
}
