"""Request bodies in `/openapi.json`.

Routes read their bodies themselves (`body.parse`: bounded in size and time, read once and shared
with the signature check, parsed strictly), so FastAPI never sees a body parameter and would
document none. This table says which protocol model each route parses, or that it takes raw
bytes; `document_bodies` adds them to the generated schema, each model under
`components/schemas` with the models it refers to.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from decentrl.envd_wire import EnvServerAnnounce, EpisodeClaim, EpisodeFailed
from decentrl.protocol import (
    API_PREFIX,
    BatchAck,
    BatchRequest,
    LeaseRequest,
    PeerAnnounce,
    PeerReport,
    RegisterRequest,
    RolloutSubmission,
    ScoreJobsRequest,
    StepMetrics,
    TermScoreBatch,
    TrainerKey,
    TrainerPeerAnnounce,
    TrainerRun,
    VerdictBatch,
    VerifyJobsRequest,
)
from decentrl.stage_wire import StageAnnounce, StageReport

WEIGHTS = f"{API_PREFIX}/weights"
RAW = "application/octet-stream"
"""A route that takes bytes as they are (a weight chunk, a signed manifest)."""

REQUEST_BODIES: dict[tuple[str, str], type[BaseModel] | str] = {
    ("post", f"{API_PREFIX}/workers/register"): RegisterRequest,
    ("post", f"{API_PREFIX}/leases"): LeaseRequest,
    ("post", f"{API_PREFIX}/rollouts"): RolloutSubmission,
    ("post", f"{API_PREFIX}/trainer/batches"): BatchRequest,
    ("post", f"{API_PREFIX}/trainer/leases"): LeaseRequest,
    ("post", f"{API_PREFIX}/trainer/rollouts"): RolloutSubmission,
    ("post", f"{API_PREFIX}/trainer/batches/{{batch_id}}/ack"): BatchAck,
    ("post", f"{API_PREFIX}/trainer/metrics"): StepMetrics,
    ("post", f"{API_PREFIX}/scorer/jobs"): ScoreJobsRequest,
    ("post", f"{API_PREFIX}/scorer/scores"): TermScoreBatch,
    ("post", f"{API_PREFIX}/verifier/jobs"): VerifyJobsRequest,
    ("post", f"{API_PREFIX}/verifier/verdicts"): VerdictBatch,
    ("put", f"{API_PREFIX}/trainer/key"): TrainerKey,
    ("put", f"{API_PREFIX}/trainer/run"): TrainerRun,
    ("put", f"{WEIGHTS}/chunks/{{digest}}"): RAW,
    ("put", f"{WEIGHTS}/manifests/{{version}}/{{kind}}"): RAW,
    ("post", f"{WEIGHTS}/peers"): PeerAnnounce,
    ("post", f"{WEIGHTS}/peers/report"): PeerReport,
    ("post", f"{WEIGHTS}/trainer-peers"): TrainerPeerAnnounce,
    ("post", f"{API_PREFIX}/stages/announce"): StageAnnounce,
    ("post", f"{API_PREFIX}/stages/report"): StageReport,
    ("post", f"{API_PREFIX}/relay/{{holder_id}}/{{lease_id}}/stage/{{action}}"): RAW,
    ("post", f"{API_PREFIX}/relay/exchange"): RAW,
    ("put", f"{API_PREFIX}/envd/servers"): EnvServerAnnounce,
    ("post", f"{API_PREFIX}/envd/episodes"): EpisodeClaim,
    ("post", f"{API_PREFIX}/envd/failures"): EpisodeFailed,
}


def _body(model: type[BaseModel] | str, schemas: dict[str, Any]) -> dict:
    if isinstance(model, str):
        return {"required": True, "content": {model: {"schema": {"type": "string", "format": "binary"}}}}
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas.setdefault(model.__name__, schema)
    reference = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"required": True, "content": {"application/json": {"schema": reference}}}


def document_bodies(app: FastAPI) -> None:
    """Make `app.openapi()` (served as /openapi.json) declare every route's request body."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for (method, path), model in REQUEST_BODIES.items():
                operation = schema.get("paths", {}).get(path, {}).get(method)
                if operation is not None:
                    operation["requestBody"] = _body(model, schemas)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # FastAPI's documented way to customise the schema
