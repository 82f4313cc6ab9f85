"""Blame per stage: real stage holders on loopback, a real driver, the verifier's recomputation.

A 3-stage tiny model (driver = stage 0, holders of stages 1 and 2) generates through real
`StageServer`s over HTTP with signed requests; the holders' lease lookup (the coordinator's
`/v1/stages/leases/{id}` answer) comes from a local table. Each trace then goes through the
coordinator's byte-level checks and the verifier's per-stage recomputation. Honest routes are
never blamed (20 seeds per codec); each corruption is blamed on the stage that made it."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest
import torch

from decentrl.config import ModelConfig
from decentrl.coordinator.http.errors import ApiError
from decentrl.coordinator.trust.stage_traces import _segment
from decentrl.model.stages import load_stage
from decentrl.model.tiny import build_tiny, save_model_dir
from decentrl.protocol import Lease, RouteHop, SamplingParams, Segment, VerifyJob
from decentrl.stage_map import StageMap
from decentrl.stage_wire import StageLeaseInfo
from decentrl.trust.identity import Signer
from decentrl.verifier.stage_blame import blame, stages_over
from decentrl.weights.signing import load_or_create_key
from decentrl.worker.pipeline_engine import PipelineEngine
from decentrl.worker.stage_server import StageServer
from decentrl.worker.stage_versions import StageVersions

pytestmark = pytest.mark.timeout(120)
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=5)


class LeaseBook:
    """What a holder asks the coordinator: who drives a lease (every lease here: the one driver)."""

    def __init__(self, signer: Signer, driver: Signer, stage: int):
        self.signer, self.driver, self.stage = signer, driver, stage

    def stage_lease(self, lease_id: str) -> StageLeaseInfo:
        return StageLeaseInfo(
            lease_id=lease_id,
            driver_id="driver",
            driver_public_key=self.driver.public_key,
            version=0,
            deadline_unix=time.time() + 60,
            stages=[self.stage],
        )


class ScaledHidden(StageServer):
    """Answers its stage's hidden states scaled by 1.1: a wrong computation it commits to."""

    def _answer(self, request, session, output):  # noqa: ANN001, ANN202 - StageServer's signature
        return super()._answer(request, session, output * 1.1)


class SwappedToken(StageServer):
    """Samples honestly, then answers another token with the sampled one's log-prob."""

    def sample(self, session, logits_bv):  # noqa: ANN001, ANN202
        tokens, logprobs = super().sample(session, logits_bv)
        return [(token + 1) % logits_bv.shape[-1] for token in tokens], logprobs


class InflatedLogprob(StageServer):
    """Answers each sampled token's log-prob 0.3 nats higher."""

    def sample(self, session, logits_bv):  # noqa: ANN001, ANN202
        tokens, logprobs = super().sample(session, logits_bv)
        return tokens, [min(0.0, logprob + 0.3) for logprob in logprobs]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    built, tokenizer = build_tiny(
        ModelConfig(num_layers=3, hidden_size=64, num_heads=2, intermediate_size=128)
    )
    with torch.no_grad():
        built.model.norm.weight.mul_(30.0)  # confident, like a trained model
    return built.eval(), save_model_dir(built, tokenizer, tmp_path_factory.mktemp("model")), tokenizer


class Route:
    """A driver and holders of stages 1 and 2 (of 3) on loopback, all at version 0."""

    def __init__(self, model, tmp_path: Path, codec: str, servers: dict[int, type[StageServer]]):
        full, model_dir, tokenizer = model
        self.stage_map, self.codec = StageMap.even(3, 3, tied_embeddings=True), codec
        state = full.state_dict()
        keys = {name: Signer(load_or_create_key(tmp_path / f"{name}.pem")) for name in ("driver", "s1", "s2")}
        self.hops, self.servers = [], []
        for stage in (1, 2):
            versions = StageVersions(load_stage(model_dir, self.stage_map, stage))
            versions.load_weights({n: state[n] for n in versions.stage.names}, 0)
            book = LeaseBook(keys[f"s{stage}"], keys["driver"], stage)
            self.servers.append(servers.get(stage, StageServer)(versions, book, f"s{stage}").start())
            url, key = self.servers[-1].url, keys[f"s{stage}"].public_key
            self.hops.append(RouteHop(stage=stage, worker_id=f"s{stage}", url=url, public_key=key))
        first = StageVersions(load_stage(model_dir, self.stage_map, 0))
        first.load_weights({n: state[n] for n in first.stage.names}, 0)
        eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
        self.driver = PipelineEngine(first, keys["driver"], eos, pad, codec=codec)
        self.prompts = [tokenizer.encode(text) for text in ("12+34=", "7+8=", "5+51=", "7+8=")]
        self.keys = {hop.worker_id: hop.public_key for hop in self.hops}

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def generate(self, seed: int) -> tuple[str, list, list]:
        """One batch through the route: the lease id, the completions and their traces, each
        trace checked as the coordinator checks it at ingestion."""
        lease_id = f"l-{seed:04d}"
        lease = Lease(
            lease_id=lease_id,
            deadline_unix=time.time() + 60,
            sampling=SAMPLING,
            tasks=[],
            route=self.hops,
            policy_version=0,
        )
        self.driver.bind(lease)
        completions = self.driver.generate(self.prompts, SAMPLING, seed=seed)
        traces = [
            self.driver.take_trace(p, c.token_ids) for p, c in zip(self.prompts, completions, strict=True)
        ]
        rows = [{"stage": hop.stage, "worker_id": hop.worker_id, "version": 0} for hop in self.hops]
        for prompt, completion, trace in zip(self.prompts, completions, traces, strict=True):
            assert trace is not None
            # the byte-level checks pass: every holder answered what it committed to
            _segment(lease_id, rows, self.keys, segment(completion), trace, len(prompt), 64, self.codec)
        return lease_id, completions, traces


def segment(completion) -> Segment:  # noqa: ANN001 - an engines.base.Completion
    versions = [0] * len(completion.token_ids)
    return Segment(
        source="model", token_ids=completion.token_ids, logprobs=completion.logprobs, policy_versions=versions
    )


@pytest.fixture
def route(model, tmp_path: Path):
    started: list[Route] = []

    def start(codec: str, servers: dict[int, type[StageServer]]) -> Route:
        started.append(Route(model, tmp_path, codec, servers))
        return started[-1]

    yield start
    for item in started:
        item.close()


def verdicts(model, route: Route, completions: list, traces: list) -> list:
    full, _, tokenizer = model
    stages = stages_over(full, route.stage_map)
    found = []
    for prompt, completion, trace in zip(route.prompts, completions, traces, strict=True):
        job = VerifyJob(
            rollout_id="r",
            temperature=SAMPLING.temperature,
            prompt_token_ids=prompt,
            segments=[segment(completion)],
            pit_seed=0,
            stage_traces=[trace],
            stage_map=route.stage_map,
        )
        found.append(blame(stages, job, tokenizer.pad_token_id))
    return found


@pytest.mark.parametrize(
    ("codec", "runs"),
    [
        ("bfloat16", 20),
        pytest.param("int8", 5, marks=pytest.mark.slow),
        pytest.param("float32", 5, marks=pytest.mark.slow),
    ],
)
def test_honest_routes_are_never_blamed(model, route, codec: str, runs: int) -> None:
    honest = route(codec, {})
    for seed in range(runs):
        _, completions, traces = honest.generate(seed)
        assert verdicts(model, honest, completions, traces) == [None] * 4, seed


@pytest.mark.parametrize(
    ("servers", "stage"),
    [
        ({1: ScaledHidden}, 1),
        ({2: SwappedToken}, 2),
        ({2: InflatedLogprob}, 2),
        ({1: ScaledHidden, 2: InflatedLogprob}, 1),
    ],
)
def test_a_corrupting_holder_is_blamed_on_its_own_stage(model, route, servers, stage: int) -> None:
    hostile = route("bfloat16", servers)
    _, completions, traces = hostile.generate(seed=3)
    found = verdicts(model, hostile, completions, traces)
    assert all(item is not None and item[0] == stage for item in found), found


def test_a_trace_edited_after_the_fact_is_refused_at_ingestion(route) -> None:
    honest = route("bfloat16", {})
    lease_id, completions, traces = honest.generate(seed=5)
    hop = traces[0].hops[1]
    data = bytearray(base64.b64decode(hop.inputs))
    data[0] ^= 1  # one bit of what stage 2 received
    edited = hop.model_copy(update={"inputs": base64.b64encode(bytes(data)).decode()})
    forged = traces[0].model_copy(update={"hops": [traces[0].hops[0], edited]})
    rows = [{"stage": h.stage, "worker_id": h.holder_id, "version": 0} for h in traces[0].hops]
    with pytest.raises(ApiError, match="not the ones its holder committed to"):
        _segment(
            lease_id,
            rows,
            honest.keys,
            segment(completions[0]),
            forged,
            len(honest.prompts[0]),
            64,
            "bfloat16",
        )
