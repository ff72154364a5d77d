"""Cluster files: what programs write is what agents read; paths resolve next to the file."""

from __future__ import annotations

import os
import stat

import pytest

from ark.agent import cluster as clmod
from ark.agent.cluster import ClusterError, ClusterFile, ClusterSettings, HostTable
from ark.agent.keys import create_keypair, public_keys
from ark.core.fabric_config import FabricConfig


def _file(tmp_path, **settings) -> ClusterFile:
    hosts = []
    for name in ("gpu0", "gpu8"):
        kp = create_keypair(tmp_path / "keys", name)
        hosts.append(HostTable(name=name, control=f"tcp://127.0.0.1:{7100 + len(hosts)}",
                               api=f"ipc://{tmp_path}/{name}.sock", public_key=kp.public_key, sign_key=kp.sign_key,
                               secret_key_file=f"keys/{name}.key_secret"))
    return ClusterFile(cluster=ClusterSettings(**settings), fabric=FabricConfig(preset="paper"), hosts=hosts)


def test_saved_file_loads_back_with_paths_resolved(tmp_path) -> None:
    f = _file(tmp_path, policy="ark-balance", lease_min_s=0.5, pathmap_dir="maps")
    path = f.save(tmp_path / "c.toml")
    c = clmod.load(path)
    assert c.policy == "ark-balance" and c.lease_min_s == 0.5 and c.pathmap_dir == str(tmp_path / "maps")
    assert [h.name for h in c.hosts] == ["gpu0", "gpu8"] and [h.index for h in c.hosts] == [0, 8]
    assert c.hosts[1].secret_key_file == str(tmp_path / "keys" / "gpu8.key_secret")
    assert c.pathmap_file("gpu0", "gpu8") == tmp_path / "maps" / "gpu0__gpu8__4791.json"
    assert c.lease()(10**9, 100e9) == pytest.approx(0.5 + 2.0 * 8e9 / 100e9)
    assert "[[hosts]]" in path.read_text() and "null" not in path.read_text()


def test_keys_are_private_from_the_start(tmp_path) -> None:
    kp = create_keypair(tmp_path, "h")
    assert stat.S_IMODE(os.stat(kp.secret_file).st_mode) == 0o600
    assert public_keys(kp.secret_file) == kp and len(kp.public_key) == 40 and len(kp.sign_key) == 64
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hosts": [{"name": "gpu0", "control": "tcp://a:1", "api": "ipc:///x", "public_key": "k"}]},
         "hosts[0].public_key: must be a 40-character Z85 CURVE key (ark keygen)"),
        ({"cluster": {"lease_slack": 0.5}}, "cluster.lease_slack: must be >= 1; got 0.5"),
        ({"cluster": {"port_range": "5-1"}}, "cluster.port-range: expected 0 <= LO <= HI <= 65535, got 5-1"),
        ({"cluster": {"probe_check_s": 1.0}}, "cluster.probe_check_s: must be >= 0 and needs routers_file; got 1.0"),
        ({"hosts": []}, "hosts: must be a list of length >= 1"),
    ],
)
def test_cluster_errors_name_the_field(tmp_path, change: dict, message: str) -> None:
    import msgspec

    raw = msgspec.to_builtins(_file(tmp_path))
    raw.update(change)
    with pytest.raises(ClusterError) as e:
        clmod.from_dict(raw)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
