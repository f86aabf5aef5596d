"""``Settings``: every option of ``Profiler`` and ``FXProfilerCallback``, declared, defaulted and checked once.

Both constructors take the options as keywords and hand them here (``Settings.of``); the table in
docs/usage.md#options documents each one (a test keeps the table and these fields the same). ``module`` and ``sinks``
are not settings: they are what is profiled and where reports go, and each constructor says what it takes.
"""

from __future__ import annotations

import difflib
import inspect
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from fxprof_lightning.analysis.roofline import Peaks
from fxprof_lightning.capture.timers import check_capture
from fxprof_lightning.schedule import Schedule
from fxprof_lightning.timing.torch_trace import check_profiler_kwargs

__all__ = ["HoldsSettings", "Settings", "takes_settings"]


@dataclass(frozen=True, kw_only=True, eq=False)
class Settings:
    """The options, with their defaults (meanings: docs/usage.md#options). Made once, by the constructor; a
    ``ValueError`` names a value that cannot work."""

    skip_first: int = 0
    wait: int = 100
    warmup: int = 1
    active: int = 3
    repeat: int = 0
    torch_profiler: bool = True
    fx_timing: bool = True
    profiler_kwargs: dict[str, Any] | None = None
    dirpath: str | os.PathLike | None = None
    top_k: int = 20
    use_gzip: bool = True
    keep_cycles: int | None = None
    profile_validation: bool = False
    module_depth: int = 3
    backward_timing: bool = True
    node_ranges: bool = True
    ranks: Sequence[int] | None = None
    peaks: Peaks | None = None
    pictures: bool = True
    verbose: bool = False
    capture: str = "dynamo"
    watch_step_time: bool = True
    overhead_budget: float | None = None
    memory: bool = True

    @classmethod
    def of(cls, owner: str, options: dict[str, Any]) -> Settings:
        """The settings from a constructor's keywords, or a ``TypeError`` naming one that is no option."""
        names = [f.name for f in fields(cls)]
        for name in options:
            if name == "schedule":
                raise TypeError(f"{owner}() takes its schedule as skip_first=, wait=, warmup=, active= and repeat= "
                                "(torch.profiler.schedule's arguments, the same meanings), not schedule=")
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise TypeError(f"{owner}() got an unknown option {name!r}: {hint}the options are {', '.join(names)} "
                                "(docs/usage.md#options)")
        return cls(**options)

    def __post_init__(self) -> None:
        self.schedule  # noqa: B018  (checks the five schedule numbers)
        if not self.torch_profiler and not self.fx_timing:
            raise ValueError("torch_profiler and fx_timing are both False: turn at least one on")
        _check_int("top_k", self.top_k, 1)
        if self.keep_cycles is not None:
            _check_int("keep_cycles", self.keep_cycles, 1, "or None (keep all)")
        _check_int("module_depth", self.module_depth, 0)
        ranks = self.ranks
        if ranks is not None and (isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence)
                                  or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)):
            raise ValueError(f"ranks must be a list of global ranks (ints >= 0) or None (all ranks), got {ranks!r}")
        check_capture(self.capture)
        if self.peaks is not None and not isinstance(self.peaks, Peaks):
            raise ValueError(f"peaks must be a fxprof_lightning.analysis.roofline.Peaks(gflops_per_s=..., "
                             f"gbytes_per_s=...) or None (measure them), got {self.peaks!r}")
        budget = self.overhead_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < 1):
            raise ValueError(f"overhead_budget must be a share of the run's wall time between 0 and 1 (0.01: 1%) or "
                             f"None (no budget: the schedule as given), got {budget!r}")
        # Checked copies: the caller's list or dict changed afterwards changes nothing here.
        object.__setattr__(self, "profiler_kwargs", check_profiler_kwargs(self.profiler_kwargs))
        object.__setattr__(self, "ranks", tuple(ranks) if ranks is not None else None)

    @property
    def schedule(self) -> Schedule:
        return Schedule(skip_first=self.skip_first, wait=self.wait, warmup=self.warmup, active=self.active,
                        repeat=self.repeat)

    @property
    def tracing_ranks(self) -> frozenset[int] | None:
        """The ranks that write traces (None: all)."""
        return None if self.ranks is None else frozenset(self.ranks)


def _check_int(name: str, value: Any, minimum: int, alternative: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' ' + alternative if alternative else ''}, got {value!r}")


def takes_settings(init: Any) -> Any:
    """``init`` (a constructor ending in ``**options``) with the settings as its keyword-only parameters in its
    signature, so that ``help()``, editors and LightningCLI's YAML configs see each option, its type and default."""
    signature = inspect.signature(init)
    hints = typing.get_type_hints(Settings)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
               for f in fields(Settings)]
    init.__signature__ = signature.replace(parameters=[*own, *options])
    return init


class HoldsSettings:
    """For the objects that hold the settings (the engine, the Lightning callback): setting one of ``fixed`` after the
    object is made raises ``AttributeError`` saying what to do instead (the checks ran when it was made, and a value
    set afterwards would reach some parts and not others), and reading an option where it is not says where it is."""

    fixed: frozenset[str] = frozenset()  # the names that may not be set
    read_as = "profiler.settings"  # where the options are read
    hints: ClassVar[dict[str, str]] = {}  # what to do instead, by name, where the default hint is wrong
    made = "settings"  # the attribute whose presence says the object is made (the guard holds from then on)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.fixed and self.made in self.__dict__:
            owner = type(self).__name__
            hint = self.hints.get(name, "pass {name}=... to {owner}(...) (read it as {read_as}.{name})")
            raise AttributeError(f"{owner}.{name} is a setting, checked when the {owner} is made: "
                                 + hint.format(owner=owner, name=name, read_as=self.read_as))
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:  # (only for names the object does not have)
        if name in OPTIONS:
            raise AttributeError(f"{type(self).__name__} keeps its options in one place: read {self.read_as}.{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


OPTIONS = frozenset(f.name for f in fields(Settings))

