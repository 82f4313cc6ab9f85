"""A K-stage pipeline on loopback, built from the worker's own parts: stage 0 in a `PipelineEngine`
(the driver), each later stage in a `StageServer` (a holder) behind a `DelayProxy`.

What the coordinator does for a staged lease is done here once, in-process: the route (one holder
per later stage, each at its proxy's address) and the answer to a holder's `/v1/stages/leases/{id}`
(`LeaseBook`: who drives the lease, with which key, until when). Every step is still signed by the
driver's Ed25519 key and checked by the holder under that key (timestamp, nonce, order), and every
session closes with the holders' signed commitments; only the lookup a holder makes once per lease
is answered without a coordinator process, which keeps the bench free of weight publication (a
staged coordinator routes only to holders of a published version).
"""

from __future__ import annotations

import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.pipeline.delay_proxy import DelayProxy, Traffic
from decentrl.client import CoordinatorClient
from decentrl.engines.base import Completion
from decentrl.model.boundary_codec import Codec
from decentrl.model.stages import load_stage
from decentrl.protocol import Lease, RouteHop, SamplingParams
from decentrl.stage_map import StageMap
from decentrl.stage_wire import StageLeaseInfo
from decentrl.trust.identity import Signer
from decentrl.worker.pipeline_engine import PipelineEngine
from decentrl.worker.stage_server import StageServer
from decentrl.worker.stage_versions import StageVersions

LEASE_SECONDS = 24 * 3600.0
VERSION = 0


class LeaseBook(CoordinatorClient):
    """A holder's coordinator client that knows one lease: the bench's."""

    def __init__(self, signer: Signer, info: StageLeaseInfo):
        super().__init__("http://127.0.0.1:9")  # never called: `stage_lease` is answered here
        self.signer = signer
        self.lease_info = info

    def stage_lease(self, lease_id: str) -> StageLeaseInfo:
        assert lease_id == self.lease_info.lease_id, lease_id
        return self.lease_info


class ConnectionPerStepServer(StageServer):
    """The holder's server answering HTTP/1.0, which closes the connection after each answer: a
    TCP handshake per step. The bench's second arm, set against the server as it ships (HTTP/1.1,
    kept connections, Nagle's algorithm off), to show what kept connections buy."""

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        handler = super()._handler()
        handler.protocol_version = "HTTP/1.0"
        handler.disable_nagle_algorithm = False  # pyright: ignore[reportAttributeAccessIssue]
        return handler


class Pipeline:
    """Stages 0..K-1 of `model_dir` loaded with `state`, the later ones served on loopback."""

    def __init__(
        self,
        model_dir: Path,
        stage_map: StageMap,
        state: dict[str, torch.Tensor],
        eos_token_ids: list[int],
        pad_token_id: int,
        codec: Codec = "bfloat16",
        keep_alive: bool = True,
    ):
        self.stage_map = stage_map
        versions = []
        for index in range(stage_map.num_stages):
            stage = load_stage(model_dir, stage_map, index)
            versions.append(StageVersions(stage, window=1))
            versions[-1].load_weights({name: state[name] for name in stage.names}, VERSION)
        driver = Signer(Ed25519PrivateKey.generate())
        self.engine = PipelineEngine(versions[0], driver, eos_token_ids, pad_token_id, codec=codec)
        lease_id = "bench-pipeline"
        deadline = time.time() + LEASE_SECONDS
        info = StageLeaseInfo(
            lease_id=lease_id,
            driver_id="driver",
            driver_public_key=driver.public_key,
            version=VERSION,
            deadline_unix=deadline,
            stages=[],
        )
        server_class = StageServer if keep_alive else ConnectionPerStepServer
        self.servers: list[StageServer] = []
        self.proxies: list[DelayProxy] = []
        self.books: list[LeaseBook] = []
        route = []
        for index in range(1, stage_map.num_stages):
            holder = Signer(Ed25519PrivateKey.generate())
            book = LeaseBook(holder, info.model_copy(update={"stages": [index]}))
            server = server_class(versions[index], book, f"holder-{index}").start()
            assert server.http is not None  # it listens (listen=True, the default)
            host, port = server.http.server_address[:2]
            proxy = DelayProxy(str(host), int(port)).start()
            route.append(
                RouteHop(
                    stage=index, worker_id=f"holder-{index}", url=proxy.url, public_key=holder.public_key
                )
            )
            self.servers.append(server)
            self.proxies.append(proxy)
            self.books.append(book)
        self.lease = Lease(
            lease_id=lease_id,
            deadline_unix=deadline,
            sampling=SamplingParams(),
            tasks=[],
            route=route,
            policy_version=VERSION,
        )

    @property
    def num_stages(self) -> int:
        return self.stage_map.num_stages

    def set_rtt(self, rtt_s: float, jitter_s: float = 0.0) -> None:
        """The round trip added between the driver and every holder."""
        for proxy in self.proxies:
            proxy.rtt_s, proxy.jitter_s = rtt_s, jitter_s

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, seed: int, codec: Codec
    ) -> list[Completion]:
        self.engine.codec = codec
        self.engine.bind(self.lease)  # a fresh lease binding: the traces of earlier batches go
        return self.engine.generate(prompts, sampling, seed)

    def traffic(self) -> list[Traffic]:
        """Per hop (stage 1, 2, ...): the bytes relayed since the last call; counters restart."""
        return [proxy.reset() for proxy in self.proxies]

    def close(self) -> None:
        self.engine.http.close()
        for proxy in self.proxies:
            proxy.close()
        for server in self.servers:
            server.close()
        for book in self.books:
            book.close()
