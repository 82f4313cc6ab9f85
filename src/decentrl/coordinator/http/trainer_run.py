"""`PUT /v1/trainer/run`: the trainer's settings and, once it has published its last version, the
end of the run (`coordinator/run_record.py`)."""

import json
import logging
from collections.abc import Callable

from fastapi import Depends, FastAPI, Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from decentrl.config import RunConfig
from decentrl.coordinator.context import Context
from decentrl.coordinator.db.store import get_meta, latest_version, set_meta
from decentrl.coordinator.http.body import parse
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.run_record import (
    RUN_COMPLETE_META,
    TRAINER_RUN_META,
    write_config,
)
from decentrl.protocol import API_PREFIX, TRAINER_SECTIONS, TrainerRun

log = logging.getLogger("decentrl.coordinator")


def record_trainer_run(context: Context, body: TrainerRun) -> dict:
    """Keep the trainer's sections (and rewrite config.json); mark the run complete once the
    trainer says so and its last version is published. True in `newly_complete` the first time."""
    try:
        sections = {name: body.sections[name] for name in TRAINER_SECTIONS}
        RunConfig.model_validate(sections)
    except (KeyError, ValidationError) as exc:
        detail = f"the trainer's sections {', '.join(TRAINER_SECTIONS)} do not parse: {str(exc)[:300]}"
        raise ApiError(422, detail, Reason.SCHEMA) from None
    newly_complete = False
    with context.store.transaction() as db:
        set_meta(db, TRAINER_RUN_META, json.dumps({"num_steps": body.num_steps, "sections": sections}))
        complete = get_meta(db, RUN_COMPLETE_META) is not None
        published = latest_version(db)
        if body.complete and not complete and published is not None and published >= body.num_steps:
            record = {"version": published, "at": context.clock()}
            set_meta(db, RUN_COMPLETE_META, json.dumps(record))
            complete = newly_complete = True
    write_config(context.run_dir, context.run, context.store)
    return {"complete": complete, "newly_complete": newly_complete}


def add_run_routes(
    app: FastAPI, context: Context, trainer: Callable, on_complete: Callable[[], None]
) -> None:
    limit = context.config.max_body_bytes

    @app.put(f"{API_PREFIX}/trainer/run", dependencies=[Depends(trainer)])
    async def trainer_run(request: Request) -> dict:
        body = await parse(request, TrainerRun, limit)
        answer = await run_in_threadpool(record_trainer_run, context, body)
        if answer.pop("newly_complete"):
            await run_in_threadpool(on_complete)
        return answer
