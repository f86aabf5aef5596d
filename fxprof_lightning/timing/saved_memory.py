"""The bytes autograd keeps for backward, per row: read after a timed forward call from the autograd nodes each row
created (found by sequence number, as backward times are), running no saved_tensors_hooks and recomputing nothing
(``torch_api.saved_tensors``; on torch 2.6-2.10 by unpacking only what no hook packed, ``SavedReader.noting_hooks``).

Each storage counts once, for the first row (in the order the forward ran) whose autograd nodes saved it: a view of a
saved tensor, or a tensor two rows save (a layer's output that the next layer saves as its input), is not counted
twice. A parameter or buffer that an op saves (a ``Linear`` saves its weight) is counted as a parameter, never as an
activation. A non-reentrant checkpointed region's ops save placeholders (nothing); its inputs, which it keeps for the
recompute, count for the first row of the region. A reentrant region's rows save nothing (they run without autograd);
its own autograd node keeps its inputs, which count for its first row too (``SavedReader.regions``). Where a ``saved_tensors_hooks`` of the user's packed what a row
saved, that row's bytes are unknown (None), and the report says why (``CycleReport.memory_note``).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fxprof_lightning import torch_api
from fxprof_lightning.timing.autograd_walk import autograd_nodes, tensors_in

if TYPE_CHECKING:
    from fxprof_lightning.timing.samples import NodeSamples

__all__ = ["SavedBytes", "SavedReader", "read_saved_bytes", "storage_key"]

_NOTHING = contextlib.nullcontext()  # (no hooks to note: one object for every call)
HOOKED = "a saved_tensors_hooks of yours packs what the layers save (CPU offload, compression...): what it keeps is its own"


@dataclass
class SavedBytes:
    """What one forward call's autograd graph keeps for backward: per row, the bytes of the activations it saved
    (summed over the row's calls in that forward call) and how many calls; the rows whose bytes are unknown and why;
    and the bytes of parameters and buffers that ops saved (counted as parameters). ``held``: per row, the activation
    bytes the call keeps for backward once the row's last node in it has run (its own and those of the rows before
    it: nothing saved is freed before the backward), so the forward's peak of saved activations builds up row by row."""

    rows: dict[int, int] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)
    unknown: set[int] = field(default_factory=set)
    why: str | None = None
    parameter_bytes: int = 0
    known: int = 0  # rows that existed when they were read (a row made later is unknown)

    def per_call(self, row: int) -> float | None:
        """Bytes the row's autograd nodes keep per call of the row (0 for a row that created none; None: unknown)."""
        if row in self.unknown or row >= self.known:
            return None
        return self.rows.get(row, 0) / max(self.calls.get(row, 1), 1)

    def held_after(self, row: int) -> float | None:
        """``held`` for the row (None: unknown, or a row that made no autograd node in the call read)."""
        if self.unknown or row >= self.known or row not in self.held:  # (a row unknown: the sums below it too)
            return None
        return float(self.held[row])


def storage_key(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    """The storage a tensor's data lives in (device, address, bytes), or None for one with no storage of its own to
    count (empty, meta, a tensor subclass without one)."""
    try:
        storage = tensor.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (str(tensor.device), address, size) if address and size else None


def _state_storages(module: nn.Module | None) -> set[tuple[str, int, int]]:
    tensors: Iterable[torch.Tensor] = (*module.parameters(), *module.buffers()) if module is not None else ()
    return {key for key in map(storage_key, tensors) if key is not None}


def read_saved_bytes(output: Any, first: int, end: int, firsts: list[int], ends: list[int], owners: list[int],
                     module: nn.Module | None, rows: int, notes: list[tuple[int, Any]] | None = None) -> SavedBytes:
    """The saved bytes per row of the forward call that made the autograd nodes ``[first, end)`` and returned
    ``output``: the nodes its output reaches, each given to the row whose call created it (``firsts``/``ends``/
    ``owners``: the node calls' sequence ranges and rows, in order); ``module``'s parameters and buffers are not
    activations; ``rows``: how many rows there are now; ``notes``: the hooks the call ran under
    (``torch_api.noting_saved_hooks``, where torch needs them)."""
    found = SavedBytes(known=rows)
    if not torch_api.READS_SAVED_TENSORS or (notes is None and not torch_api.HAS_DATA):
        torch_api.degraded("read the bytes saved for backward", "it has no torch._C._autograd.SavedTensor.data or "
                           ".unpack_hook (2.11+), nor _push/_pop_saved_tensors_default_hooks to know which saved "
                           "tensors unpack without running a saved_tensors_hooks; no saved bytes")
        found.known = 0  # (every row unknown)
        return found
    start = bisect.bisect_left(firsts, first)
    for owner in owners[start:]:
        found.calls[owner] = found.calls.get(owner, 0) + 1
    parameters = _state_storages(module)
    seen: set[tuple[str, int, int]] = set()
    frames: set[int] = set()  # checkpointed regions whose inputs are counted
    held = 0  # activation bytes kept so far, in the order the nodes were made
    roots = [t.grad_fn for t in tensors_in(output)]
    for node in sorted(autograd_nodes(roots, first, end), key=lambda fn: torch_api.node_sequence_nr(fn)):
        i = bisect.bisect_right(firsts, torch_api.node_sequence_nr(node)) - 1
        if i < start or torch_api.node_sequence_nr(node) >= ends[i]:
            continue  # made between the rows (no row owns it)
        row = owners[i]
        kept = []
        for stored, hook in torch_api.saved_tensors(node, notes):
            if hook is None:
                kept.append(stored)
                continue
            region = torch_api.checkpoint_inputs(hook, notes)
            if region is None:
                found.unknown.add(row)
                found.why = HOOKED
            elif id(region[0]) not in frames:
                frames.add(id(region[0]))
                kept += region[1]
        for tensor in kept:
            key = storage_key(tensor) if isinstance(tensor, torch.Tensor) else None
            if key is None or key in seen:
                continue
            seen.add(key)
            if key in parameters:
                found.parameter_bytes += key[2]
            else:
                found.rows[row] = found.rows.get(row, 0) + key[2]
                held += key[2]
        found.held[row] = held
    return found


class SavedReader:
    """The saved bytes a ``NodeTimer`` reads (held as its ``saved``), at the call it says (``NodeTimer.reads_saved``):
    the hooks noted around that call (``noting_hooks``), the reentrant regions it ran (``regions``), the bytes read
    after it from the sequence ranges of ``samples`` (``read``), handed over once (``take``)."""

    def __init__(self, samples: NodeSamples) -> None:
        self.samples = samples
        self.bytes: SavedBytes | None = None  # what the cycle's first measured forward call keeps for backward
        self.regions: tuple[tuple[int, int, int], ...] = ()  # (first, end, row) of the call to be read's reentrant regions
        self._hook_notes: list[tuple[int, Any]] | None = None

    def noting_hooks(self, reads: bool) -> contextlib.AbstractContextManager[None]:
        """Around a timed forward call to be read (``reads``), where torch has no ``SavedTensor.data``: the changes of
        the saved_tensors_hooks on top (``torch_api.note_saved_hooks``), or one unknown hook for all where one was
        pushed before (the public ``disable_saved_tensors_hooks`` raises then). Nothing at the other calls."""
        if torch_api.HAS_DATA or not torch_api.READS_SAVED_TENSORS or not reads:
            return _NOTHING
        return self._hooks_noted()

    @contextlib.contextmanager
    def _hooks_noted(self) -> Iterator[None]:
        try:
            with torch.autograd.graph.disable_saved_tensors_hooks("fxprof_lightning: are hooks on the stack?"):
                pass
        except RuntimeError:
            self._hook_notes = [(0, "a hook pushed before")]
            yield
            return
        self._hook_notes = []
        torch_api.note_saved_hooks(self._hook_notes)
        try:
            yield
        finally:
            torch_api.note_saved_hooks(None)

    def read(self, output: Any, first: int, module: nn.Module | None, reads: bool) -> None:
        """After a timed forward call (CPU, sequence ranges logged) that made autograd nodes from ``first`` on: the
        bytes each row's autograd nodes keep for backward, where the call is to be read (``reads``: the first such
        call of each cycle, the warm-up's where there is one: no recorded step pays for it); ``module``'s parameters
        and buffers are not activations."""
        notes, self._hook_notes = self._hook_notes, None
        regions, self.regions = self.regions, ()
        if not reads:
            return
        samples = self.samples
        samples.fold()
        firsts, ends, owners = samples.firsts, samples.ends, samples.owners
        if regions:  # (in the order the nodes were made)
            firsts, ends, owners = (list(column) for column in zip(*sorted([*zip(firsts, ends, owners), *regions]),
                                                                   strict=True))
        self.bytes = read_saved_bytes(output, first, torch_api.sequence_nr_now(), firsts, ends, owners, module,
                                      len(samples.nodes), notes)

    def take(self) -> tuple[list[float | None] | None, str | None, list[float | None] | None]:
        """Per row, the bytes its autograd nodes keep for backward per call (None: unknown), why some are unknown, and
        the bytes held once the row has run (``SavedBytes.held``); (None, None, None) where nothing was read. The next
        forward call reads them again (the next cycle)."""
        saved, self.bytes = self.bytes, None
        if saved is None:
            return None, None, None
        rows = range(len(self.samples.nodes))
        return [saved.per_call(row) for row in rows], saved.why, [saved.held_after(row) for row in rows]
