"""What a worker may announce as its chunk server, and what free text a client may send: refused at
the schema or at the announcement (422) before any worker is sent anywhere or any log is written."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import ValidationError

from decentrl.config import LOOPBACK_NETWORKS, ConfigError, load_config
from decentrl.coordinator.http.errors import ApiError, Reason
from decentrl.coordinator.weights.peers import check_peer_url
from decentrl.protocol import (
    MAX_VERSION,
    PeerAnnounce,
    PeerReport,
    RegisterRequest,
    Rollout,
    ScoreJobsRequest,
)

PRIVATE_FLEET = [ipaddress.ip_network("10.0.0.0/8")]
LOOPBACK = [ipaddress.ip_network(network) for network in LOOPBACK_NETWORKS]


@pytest.mark.parametrize(
    "url",
    [
        "http://100.100.100.200:80",  # a cloud metadata service, in the shared address space
        "http://100.64.0.1:80",
        "http://[fec0::1]:80",  # IPv6 site-local
        "http://169.254.169.254:80",
        "http://10.1.2.3:80",
        "http://127.0.0.1:80",
        "http://[::ffff:10.0.0.1]:80",  # IPv4-mapped, 6to4 and NAT64 forms of a private address
        "http://[2002:a00:1::]:80",
        "http://[64:ff9b::a00:1]:80",
        "http://0.0.0.0:80",
    ],
)
def test_only_globally_routable_peers_are_accepted_by_default(url: str) -> None:
    with pytest.raises(ApiError) as refused:
        check_peer_url(url, [])
    assert refused.value.status == 422 and refused.value.reason is Reason.PEER_URL


def test_the_allowlist_admits_a_private_fleet_but_never_link_local() -> None:
    check_peer_url("http://8.8.8.8:9000", [])
    check_peer_url("http://[2001:4860::1]:9000", [])
    check_peer_url("http://10.1.2.3:9000", PRIVATE_FLEET)
    check_peer_url("http://127.0.0.1:9000", LOOPBACK)
    check_peer_url("http://[::1]:9000", LOOPBACK)
    for url, networks in (
        ("http://169.254.169.254:80", [ipaddress.ip_network("169.254.0.0/16")]),
        ("http://192.168.1.1:80", PRIVATE_FLEET),
    ):
        with pytest.raises(ApiError):
            check_peer_url(url, networks)


@pytest.mark.parametrize(
    "url",
    [
        "http://8.8.8.8:80/latest/meta-data",  # a path of the announcer's choosing
        "http://8.8.8.8:80?x=1",
        "http://8.8.8.8:80/#frag",
        "http://user@8.8.8.8:80",
        "http://example.com:80",
        "http://8.8.8.8",
    ],
)
def test_a_peer_announces_scheme_address_and_port_only(url: str) -> None:
    with pytest.raises(ValidationError):
        PeerAnnounce(url=url, version=0)


def test_a_peer_version_fits_the_store() -> None:
    with pytest.raises(ValidationError):
        PeerAnnounce(url="http://8.8.8.8:80", version=2**63)
    assert PeerAnnounce(url="http://8.8.8.8:80", version=MAX_VERSION).version == MAX_VERSION


@pytest.mark.parametrize("text", ["hf\u202e", "a\nb", "x\x1b[2J", "zero\u200bwidth", "line\u2028sep", "\x00"])
def test_free_text_from_clients_refuses_control_and_bidi_characters(text: str) -> None:
    with pytest.raises(ValidationError):
        RegisterRequest(name="w", engine=text)
    with pytest.raises(ValidationError):
        PeerReport(worker_id="w", sha256="0" * 64, reason=text)
    with pytest.raises(ValidationError):
        ScoreJobsRequest(term=text)
    with pytest.raises(ValidationError, match="control or bidi"):
        Rollout.model_validate(
            {
                "lease_id": "l",
                "task_id": "t",
                "slot": 0,
                "prompt_token_ids": [1],
                "segments": [{"source": "model", "token_ids": [1]}],
                "sampling": {},
                "finish_reason": "stop",
                "timings": {text: 1.0},
            }
        )


def test_printable_text_of_any_script_passes() -> None:
    assert RegisterRequest(name="w", engine="vllm-0.8 (ünïcode, 日本語)").engine.startswith("vllm")
    assert PeerReport(worker_id="w", sha256="0" * 64, reason="hash mismatch").reason == "hash mismatch"


def test_peer_networks_are_checked_when_the_config_loads() -> None:
    assert load_config(None, ['weights.peer_networks=["10.0.0.0/8"]']).weights.peer_networks == ["10.0.0.0/8"]
    with pytest.raises(ConfigError, match="CIDR"):
        load_config(None, ['weights.peer_networks=["10.0.0.0/33"]'])
