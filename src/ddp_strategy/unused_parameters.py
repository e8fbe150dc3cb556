"""Parameters that take no part in the loss under DDP's ``find_unused_parameters=False``, named by module path.

DDP's reducer expects a gradient for every trainable parameter in each backward. A parameter without one (a layer
left out of the loss, an auxiliary head not wired in) keeps its bucket from being averaged, and the next forward
fails inside DDP with "Expected to have finished reduction in the prior iteration", which Lightning replaces by a
hint to use stock DDP (``strategy='ddp_find_unused_parameters_true'``). Both name no parameter.

:class:`UnusedParameterCheck` looks once, after the first backward of each DDP wrapper (automatic optimization):
every rank lists its trainable parameters without a gradient, the ranks gather the lists on the control plane, and
every rank raises the same :class:`~ddp_strategy.errors.UnusedParametersError` before the optimizer steps. A
parameter that goes unused only later (a branch taken from some step on) reaches DDP's own error, which
:meth:`UnusedParameterCheck.error_instead` turns into the same named error from the parameter indices in DDP's
message. Cost: one attribute comparison per backward after the first.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .errors import DDPStrategyError, UnusedParametersError

if TYPE_CHECKING:
    from .control import ControlPlane

__all__ = [
    "UnusedParameterCheck",
    "missing_gradients_cause",
    "reducer_parameter_names",
    "unused_parameters_message",
]

#: The start of DDP's error when a parameter of the previous iteration got no gradient.
DDP_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"
_DDP_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_MOST_LISTED = 20


def reducer_parameter_names(ddp: DistributedDataParallel) -> list[tuple[str, Any]]:
    """``(name, parameter)`` in the order of DDP's reducer, whose indices DDP's error message uses.

    DDP registers the trainable parameters of each submodule in ``named_modules()`` order (``recurse=False``), minus
    ``parameters_to_ignore``, each shared parameter once (``DistributedDataParallel._build_params_for_reducer``).
    """
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    seen: set[int] = set()
    named = []
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if not param.requires_grad or name in ignored or id(param) in seen:
                continue
            seen.add(id(param))
            named.append((name, param))
    return named


def unused_parameters_message(
    parameters: Mapping[int, Sequence[str]], *, world_size: int, step: int | None, when: str
) -> str:
    """The error's text: which parameters on which ranks, why it matters, and the fixes that keep the strategy."""
    lists = {rank: tuple(names) for rank, names in sorted(parameters.items()) if names}
    distinct = set(lists.values())

    if len(distinct) == 1:
        (names,) = distinct
        ranks = "every rank" if len(lists) == world_size else "rank(s) " + ", ".join(map(str, lists))
        where = f"on {ranks}: {_shown(names)}"
    else:
        where = "; ".join(f"rank {rank}: {_shown(names)}" for rank, names in lists.items())
    at = f" at step {step}" if step is not None else ""
    return (
        f"ddp_strategy: trainable parameters took no part in the loss{at} ({when}) {where}. DDP "
        "(find_unused_parameters=False, the default) expects a gradient for every trainable parameter in each "
        "backward; without one the gradients of their bucket are never averaged across ranks. Fix: use them in the "
        "loss, freeze them (requires_grad_(False) before fit) or remove them; if they are unused on purpose, pass "
        "SafeDDPStrategy(find_unused_parameters=True) (DDP then searches the graph at every step), or "
        "SafeDDPStrategy(static_graph=True) when the same parameters are unused at every step."
    )


def _shown(names: Sequence[str]) -> str:
    more = f" and {len(names) - _MOST_LISTED} more" if len(names) > _MOST_LISTED else ""
    return ", ".join(names[:_MOST_LISTED]) + more


def missing_gradients_cause(model: object) -> str:
    """For a divergence message: this rank's parameters without a gradient in the last backward, as the cause.

    ``""`` unless ``model`` is a DDP wrapper without either remedy in which some trainable parameters hold a
    gradient and others none (the gradients of the last backward are kept until the next step's ``zero_grad``).
    """
    if not UnusedParameterCheck.applies(model):
        return ""
    assert isinstance(model, DistributedDataParallel)
    named = reducer_parameter_names(model)
    missing = [name for name, param in named if param.grad is None]
    if not missing or len(missing) == len(named):
        return ""
    return (
        f"The most likely cause: on this rank, {_shown(missing)} had no gradient in the last backward (they took no "
        "part in the loss), so with DDP's find_unused_parameters=False (the default) the gradients of their bucket "
        "were not averaged across ranks. Use them in the loss, or pass SafeDDPStrategy(find_unused_parameters=True)."
    )


def dist_world_size() -> int:
    """The default group's size (``1`` without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class UnusedParameterCheck:
    """Names parameters without a gradient once per DDP wrapper, and in DDP's own error (see the module docstring).

    Args:
        control: returns the control plane (``None`` outside a stage), for the gather of every rank's list.

    """

    def __init__(self, control: Callable[[], ControlPlane | None]) -> None:
        self._control = control
        #: The DDP wrapper whose first backward was looked at (compare before calling :meth:`after_backward`).
        self.checked: object | None = None

    @staticmethod
    def applies(model: object) -> bool:
        """Whether DDP raises for a parameter without a gradient: a DDP wrapper without either remedy."""
        return (
            isinstance(model, DistributedDataParallel)
            and not getattr(model, "find_unused_parameters", True)
            and not getattr(model, "static_graph", False)
        )

    def after_backward(self, model: object, module: Any, trainer: Any) -> None:
        """After a backward: the first one of each wrapper gathers every rank's parameters without a gradient.

        Collective (every rank of a DDP run reaches its first backward), once per wrapper; a comparison after.

        Args:
            model: the strategy's model (the DDP wrapper).
            module: the LightningModule (``None`` when not connected).
            trainer: the Trainer (``None`` when not attached), for the step number.

        Raises:
            UnusedParametersError: on every rank, when any rank has such parameters.

        """
        if model is self.checked:
            return
        self.checked = model
        control = self._control()
        automatic = module is None or bool(module.automatic_optimization)
        step = trainer.global_step + 1 if trainer is not None else None  # the step whose backward this was
        if not automatic or control is None or not self.applies(model):
            return  # manual optimization may leave parameters for a second backward; DDP's error is translated
        assert isinstance(model, DistributedDataParallel)
        unused = [name for name, param in reducer_parameter_names(model) if param.grad is None]
        gathered = control.all_gather_object(unused, "unused parameters")
        per_rank = dict(enumerate(gathered))
        if any(per_rank.values()):
            when = "after the first backward"
            message = unused_parameters_message(per_rank, world_size=len(gathered), step=step, when=when)
            raise UnusedParametersError(message, parameters=per_rank, step=step)

    def error_instead(self, model: object, error: BaseException, trainer: Any) -> BaseException | None:
        """For DDP's "Expected to have finished reduction" error: the named error for this rank, else ``None``.

        Args:
            model: the strategy's model (the DDP wrapper).
            error: the error the run raised.
            trainer: the Trainer (``None`` when not attached); its last completed step lacked the gradients.

        """
        step = trainer.global_step if trainer is not None else None
        text = str(error)
        if isinstance(error, DDPStrategyError) or DDP_UNFINISHED_REDUCTION not in text:
            return None
        if not isinstance(model, DistributedDataParallel):
            return None
        found = _DDP_INDICES.search(text)
        if found is None:
            return None
        names = reducer_parameter_names(model)
        indices = [int(i) for i in found.group(2).split()]
        unused = [names[i][0] if i < len(names) else f"<parameter index {i}>" for i in indices]
        per_rank = {int(found.group(1)): unused}
        when = "DDP found it at the next step's forward"
        message = unused_parameters_message(per_rank, world_size=dist_world_size(), step=step, when=when)
        return UnusedParametersError(message, parameters=per_rank, step=step)
