"""The coordinator's weight routes (see docs/protocol.md, "Weights" and docs/weights.md).

Trainer: register its public key, upload chunks, then the signed manifest (a patch is named by its
version and `?anchor=`, as a version may have one per anchor). Workers and trainer:
latest version, the index of retained manifests, manifests, chunks (optionally rate-limited by
`weights.upload_bytes_per_second`), and a request for a full snapshot with the next version. Workers: announce their chunk server, get peer lists, report
a peer that served a bad chunk. Stage trainers (`weights.store = "peers"`): announce theirs.
"""

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from decentrl.coordinator.context import Context
from decentrl.coordinator.http.body import parse, read_body
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.weights.peers import PeerTable
from decentrl.coordinator.weights.stage_signed import open_weight_store
from decentrl.coordinator.weights.versions import WeightStore
from decentrl.protocol import API_PREFIX, PeerAnnounce, PeerReport, TrainerKey, TrainerPeerAnnounce
from decentrl.trust.ratelimit import RateLimiter
from decentrl.weights.bandwidth import TokenBucket
from decentrl.weights.manifest import ManifestKey

CHUNK_BODY_LIMIT = 256 << 20
MANIFEST_BODY_LIMIT = 64 << 20
WEIGHTS = f"{API_PREFIX}/weights"


async def _throttled(data: bytes, bucket: TokenBucket) -> AsyncIterator[bytes]:
    for piece in bucket.pieces(data):
        await asyncio.sleep(bucket.reserve(len(piece)))
        yield bytes(piece)


def _manifest_key(version: int, kind: str, anchor: int | None) -> ManifestKey:
    """A manifest's name from its URL: a patch needs `?anchor=`, the other kinds take none."""
    if kind not in ("snapshot", "delta", "patch"):
        raise ApiError(404, "manifest kind must be 'snapshot', 'delta' or 'patch'", Reason.UNKNOWN)
    if (kind == "patch") != (anchor is not None):
        raise ApiError(422, "a patch is named by ?anchor=VERSION, and only a patch", Reason.SCHEMA)
    return (version, kind, anchor)


def add_weight_routes(
    app: FastAPI, context: Context, trainer: Callable, worker: Callable, client: Callable
) -> WeightStore:
    store = open_weight_store(context)
    peers = PeerTable(context)
    app.state.weights, app.state.peers = store, peers
    cap = context.run.weights.upload_bytes_per_second
    bucket = TokenBucket(cap) if cap else None
    limit = context.config.max_body_bytes

    @app.put(f"{API_PREFIX}/trainer/key", dependencies=[Depends(trainer)])
    async def trainer_key(request: Request) -> dict:
        body = await parse(request, TrainerKey, limit)
        return await run_in_threadpool(store.register_key, body)

    @app.put(f"{WEIGHTS}/chunks/{{digest}}", dependencies=[Depends(trainer)])
    async def put_chunk(digest: str, request: Request) -> dict:
        if len(digest) != 64:
            raise ApiError(422, "a chunk name is 64 lowercase hex digits", Reason.SCHEMA)
        data = await read_body(request, CHUNK_BODY_LIMIT)
        return await run_in_threadpool(store.put_chunk, digest, data)

    @app.put(f"{WEIGHTS}/manifests/{{version}}/{{kind}}", dependencies=[Depends(trainer)])
    async def put_manifest(
        version: int, kind: str, request: Request, anchor: int | None = None, stage: int | None = None
    ) -> dict:
        key = _manifest_key(version, kind, anchor)
        data = await read_body(request, MANIFEST_BODY_LIMIT)
        return (await run_in_threadpool(store.put_manifest, key, data, stage)).model_dump()

    @app.get(f"{WEIGHTS}/latest", dependencies=[Depends(client)])
    def latest() -> dict:
        info = store.latest()
        if info is None:
            raise ApiError(404, "no policy version published yet", Reason.UNKNOWN_VERSION)
        return info.model_dump()

    @app.get(f"{WEIGHTS}/index", dependencies=[Depends(client)])
    def index() -> list[dict]:
        return [entry.model_dump() for entry in store.index()]

    @app.get(f"{WEIGHTS}/manifests/{{version}}/{{kind}}", dependencies=[Depends(client)])
    def manifest(version: int, kind: str, anchor: int | None = None, stage: int | None = None) -> Response:
        body = store.stage_manifest(_manifest_key(version, kind, anchor), stage).model_dump_json()
        return Response(body, media_type="application/json")

    @app.get(f"{WEIGHTS}/chunks/{{digest}}", dependencies=[Depends(client)], response_model=None)
    def chunk(digest: str) -> Response:
        path = store.chunk_path(digest)
        if bucket is None:
            return FileResponse(path, media_type="application/octet-stream")
        data = path.read_bytes()
        headers = {"Content-Length": str(len(data))}
        return StreamingResponse(
            _throttled(data, bucket), media_type="application/octet-stream", headers=headers
        )

    hourly = context.run.weights.snapshot_requests_per_hour
    snapshot_asks = RateLimiter(hourly / 3600.0, hourly)

    @app.post(f"{WEIGHTS}/snapshot-request")
    async def snapshot_request(who: Annotated[str, Depends(client)]) -> dict:
        if who != "trainer" and not snapshot_asks.allow(who, context.clock()):
            raise ApiError(
                429, f"at most {hourly} snapshot requests per hour; retry later", Reason.RATE_LIMITED
            )
        return await run_in_threadpool(store.request_snapshot, who)

    @app.post(f"{WEIGHTS}/peers")
    async def announce(request: Request, worker_id: Annotated[str, Depends(worker)]) -> dict:
        body = await parse(request, PeerAnnounce, limit)
        await run_in_threadpool(peers.announce, worker_id, body)
        listed = await run_in_threadpool(peers.listing, worker_id)
        return {"peers": [peer.model_dump() for peer in listed]}

    @app.get(f"{WEIGHTS}/peers")
    def listing(who: Annotated[str, Depends(client)]) -> dict:
        return {"peers": [peer.model_dump() for peer in peers.listing(who)]}

    @app.post(f"{WEIGHTS}/trainer-peers", dependencies=[Depends(trainer)])
    async def announce_trainer(request: Request) -> dict:
        body = await parse(request, TrainerPeerAnnounce, limit)
        peers.announce_trainer(body)
        return {"stage": body.stage, "url": body.url}

    @app.post(f"{WEIGHTS}/peers/report")
    async def report(request: Request, worker_id: Annotated[str, Depends(worker)]) -> dict:
        body = await parse(request, PeerReport, limit)
        return await run_in_threadpool(peers.report, worker_id, body)

    return store
