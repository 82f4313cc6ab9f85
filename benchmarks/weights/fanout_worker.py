"""One simulated worker of the fan-out benchmark, as its own process (no torch imported).

It registers like a real worker (its own Ed25519 request key), optionally runs its peer chunk
server and announces it, waits for the start signal, then fetches the new version exactly as a
worker does: the signed manifest (signature checked) and every chunk through `ChunkFetcher`
(peers' have-lists first, the coordinator last, each chunk hashed). It reports when it holds the
whole verified version, and keeps serving its chunks until told to stop.
"""

from __future__ import annotations

import time
from pathlib import Path

from decentrl.client import CoordinatorClient
from decentrl.protocol import PeerAnnounce, RegisterRequest
from decentrl.trust.identity import Signer, load_or_create_worker_key
from decentrl.weights.chunks import ChunkStore
from decentrl.weights.manifest import Manifest
from decentrl.weights.peer_server import PeerServer
from decentrl.weights.signing import parse_public_key, verify
from decentrl.weights.transfer import COORDINATOR, ChunkFetcher


def worker_main(settings: dict, ready, start, stop, results) -> None:  # noqa: ANN001 - multiprocessing objects
    root = Path(settings["root"])
    root.mkdir(parents=True, exist_ok=True)
    client = CoordinatorClient(settings["url"], max_wait=120)
    client.signer = Signer(load_or_create_worker_key(root))
    request = RegisterRequest(name=f"sim-{settings['index']}", public_key=client.signer.public_key)
    client.token = client.register(request, settings["enroll_token"]).token
    store = ChunkStore(root / "chunks", durable=False)
    fetcher = ChunkFetcher(client, store, seed=settings["index"])
    server = None
    if settings["relay"]:
        server = PeerServer(store, bytes_per_second=settings["upload"]).start()
        client.announce_peer(PeerAnnounce(url=server.url, version=-1))
    ready.put(settings["index"])
    start.wait()
    if server is not None:
        fetcher.peers = client.peers()
    manifest = Manifest.model_validate_json(client.manifest_bytes(0, "snapshot"))
    verify(manifest, parse_public_key(settings["public_key"]))
    fetcher.fetch(manifest.chunks)
    assert not store.missing(manifest.chunks)
    results.put(
        {
            "finished": time.time(),
            "coordinator_bytes": fetcher.bytes_from[COORDINATOR],
            "peer_bytes": sum(fetcher.bytes_from.values()) - fetcher.bytes_from[COORDINATOR],
        }
    )
    stop.wait()
    if server is not None:
        server.stop()
    fetcher.close()
    client.close()
