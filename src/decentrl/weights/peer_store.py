"""A stage trainer's chunks, served by itself: the chunk store of `weights.store = "peers"`.

In that mode the coordinator never holds a chunk (`coordinator/weights/stage_signed.py`). Each
stage trainer writes the chunks of what it publishes into its own store (`run_dir/trainer/stage-S/
chunks`), serves them with the workers' chunk server (`peer_server.py`: `GET /chunks`, `GET
/chunks/{sha256}`) and announces that server to the coordinator for its stage (`POST
/v1/weights/trainer-peers`) at start and after every publication. The coordinator lists the stage
trainers first among the peers, as established ones; the stage's holders fetch from them, verify
every chunk against the signed manifest, and serve what they hold to each other (each holder's own
chunk server), so a trainer sends each chunk about once per version however many holders there are.
A holder behind NAT downloads and serves no one; the relay for steps (`coordinator/stage_relay.py`)
does not carry chunks.

The trainer keeps the chunks of the versions the coordinator retains (the newest
`weights.keep_versions` and the newest snapshot before them, the same rule), so a holder that was
away can still catch up; older ones are deleted as new versions go out. No torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from decentrl.client import CoordinatorClient
from decentrl.protocol import TrainerPeerAnnounce
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.peer_server import PeerServer

log = logging.getLogger(__name__)


def stage_chunks(run_dir: Path, stage: int) -> Path:
    """Where stage trainer `stage` of the trainer run directory `run_dir` keeps its chunks."""
    return run_dir / "trainer" / f"stage-{stage}" / "chunks"


ManifestName = tuple[int, str, int | None]
"""(version, kind, anchor) of one of this stage's manifests."""


@dataclass
class TrainerChunks:
    """Stage `stage`'s published chunks and the server that hands them out."""

    store: ChunkStore
    stage: int
    keep_versions: int
    host: str = "127.0.0.1"
    url: str | None = None
    """The address announced (`trainer.peer_url`); None: the server's own."""
    published: dict[ManifestName, set[str]] = field(default_factory=dict)
    """The chunks of each manifest this process published (older ones stay until a restart's
    first retention pass finds no manifest naming them; see `prune`)."""

    def __post_init__(self) -> None:
        self.server = PeerServer(self.store, self.host, 0).start()

    @property
    def address(self) -> str:
        return self.url or self.server.url

    def record(self, name: ManifestName, digests: list[str]) -> None:
        self.published[name] = set(digests)

    def announce(self, client: CoordinatorClient, version: int) -> None:
        client.announce_trainer_peer(TrainerPeerAnnounce(stage=self.stage, url=self.address, version=version))

    def prune(self) -> int:
        """Drop the chunks of manifests older than what the coordinator retains; returns how many.
        A chunk this process never recorded (written before a restart) is kept: it may belong to a
        version still retained."""
        versions = sorted({name[0] for name in self.published})
        if not versions:
            return 0
        start = versions[-1] - self.keep_versions + 1
        snapshots = [name[0] for name in self.published if name[1] == "snapshot" and name[0] <= start]
        oldest = min(start, max(snapshots)) if snapshots else versions[0]
        dropped = [name for name in self.published if name[0] < oldest]
        unwanted = set().union(*(self.published.pop(name) for name in dropped)) if dropped else set()
        wanted = set().union(*self.published.values())
        for digest in unwanted - wanted:
            self.store.remove(digest)
        return len(unwanted - wanted)

    def close(self) -> None:
        self.server.stop()
