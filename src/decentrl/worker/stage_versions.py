"""A stage holder's recent versions of its stage, so that drivers on any of them find a route.

Pipeline version v means every stage of a route computes at v. Drivers load new versions between
their generations and holders between their steps, at different moments; a holder that kept only
its newest version would break every route whose driver is one version behind. So it keeps the
last `window` versions of its stage's tensors and switches its live parameters to a session's
version before each step. Versions share unchanged tensors (copy on write): a LoRA run's deltas
touch only the adapters, so each kept version costs only those; a full-parameter run's cost up to
one stage copy each.

To `WorkerWeights` this is the engine (`load_weights`, `update_weights`, `policy_version`): what it
hands over is only this stage's tensors, fetched and verified by their stage's hashes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from decentrl.model.stages import Stage

DEFAULT_WINDOW = 4


class StageVersions:
    def __init__(self, stage: Stage, window: int = DEFAULT_WINDOW, record: Path | None = None):
        assert window >= 1
        self.stage = stage
        self.record = record
        """Where the names of the parameters this process allocated are kept, one a line, rewritten
        whenever they change (LoRA adapters appear with the first weights): the evidence that a
        holder held only its stage."""
        self.recorded: frozenset[str] = frozenset()
        self.window = window
        self.versions: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.live: int | None = None
        self.serves_adapters = True
        self._lock = threading.Lock()

    @property
    def policy_version(self) -> int:
        """The newest version held (-1 before the first)."""
        return next(reversed(self.versions), -1)

    @property
    def oldest_version(self) -> int:
        return next(iter(self.versions), -1)

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    @property
    def hidden_size(self) -> int:
        return int(self.stage.config.hidden_size)

    def held(self) -> list[int]:
        return list(self.versions)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """A whole stage state (a snapshot): the window restarts from it."""
        kept = {name: tensor.detach().clone() for name, tensor in state_dict.items()}
        with self._lock:
            self.versions.clear()
            self.versions[version] = kept
            self.live = None
        self.ensure(version)

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """The tensors a delta changed, over the newest version held (the first: the whole stage)."""
        if not self.versions:
            self.load_weights(tensors, version)
            return
        with self._lock:
            newest = dict(self.versions[next(reversed(self.versions))])
            newest.update({name: tensor.detach().clone() for name, tensor in tensors.items()})
            self.versions[version] = newest
            while len(self.versions) > self.window:
                self.versions.popitem(last=False)

    def ensure(self, version: int) -> bool:
        """Make `version` the live parameters (copying only the tensors that differ); False when it
        is not held. Called under the server's compute lock, between steps."""
        with self._lock:
            target = self.versions.get(version)
            if target is None:
                return False
            if self.live == version:
                return True
            current = self.versions.get(self.live) if self.live is not None else None
            changed = (
                target
                if current is None
                else {name: tensor for name, tensor in target.items() if current.get(name) is not tensor}
            )
            if current is None:
                self.stage.load_weights(changed)
            elif changed:
                self.stage.update_weights(changed)
            self.live = version
            self._record()
            return True

    def _record(self) -> None:
        names = self.stage.materialised
        if self.record is not None and names != self.recorded:
            self.record.write_text("".join(f"{name}\n" for name in sorted(names)))
            self.recorded = names
