"""The namespace testbed: layout and maps everywhere; build, probing and runs as root."""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pytest

from ark.agent.cluster import ClusterSettings
from ark.agent.probe import ProbeError, ProbeResult, pathmap_from_probes, probe_ports, sample_ports
from ark.core.pathmap import PROBED, PathMap, PathMapError, PortBuckets
from ark.core.protocol import ArkCore
from ark.core.topology import spine_leaf
from ark.testbed import fabric as tbm
from ark.testbed import netns as netns
from ark.testbed.fabric import Layout, State

SMALL = dict(leaves=2, spines=4, gpus_per_leaf=2, prefix="arkt")


# --------------------------------------------------------------------------- no root
def test_layout_addresses_are_distinct_and_name_spines():
    lay = Layout(tbm.TestbedSpec())
    ns = lay.namespaces()
    assert len(ns) == len(set(ns)) == 1 + 4 + 2 + 16
    assert all(len(n) <= 15 for n in ns)
    assert lay.host_ip(0) == "10.0.0.1" and lay.host_ip(8) == "10.0.1.1"
    assert lay.gateway(1) == "10.0.1.254" and lay.host_subnet(1) == "10.0.1.0/24"
    routers = lay.routers()
    assert len(routers) == 8 and sorted(set(routers.values())) == [0, 1, 2, 3]
    assert routers[lay.uplink_ips(1, 3)[1]] == 3
    assert len({lay.mgmt_ip(i) for i in range(16)}) == 16


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"hash_policy": "crc"}, "hash_policy"), ({"port_range": (40000, 50000)}, "port_range"),
     ({"prefix": "a-b"}, "prefix"), ({"scale": 2.0}, "scale"), ({"queue_ms": 0.0}, "queue_ms")],
)
def test_spec_errors_name_the_field(kw, field):
    with pytest.raises(tbm.TestbedError, match=f"^{field}: "):
        tbm.TestbedSpec(**kw).check()


def test_scaled_fabric_carries_the_scaled_rates():
    s = tbm.TestbedSpec(scale=1e-3)
    assert s.scaled_fabric().link_bps == pytest.approx(1e8)
    assert s.fabric().link_bps == pytest.approx(1e11)


def _probed(buckets, rng=(100, 199)):
    return PathMap(PROBED, 0, PROBED, "10.0.0.1", "10.0.1.1", 5201, rng,
                   tuple(np.asarray(b, dtype=np.int64) for b in buckets), 6)


def test_probed_map_is_partial_and_round_trips(tmp_path):
    pm = _probed([[100, 150], [101], [], [199]])
    assert pm.sampled and pm.path_of(150) == 0 and pm.path_of(120) == -1
    pm.save(tmp_path / "m.json")
    back = PathMap.load(tmp_path / "m.json")
    assert back.counts() == [2, 1, 0, 1] and back.proto == 6 and back.sampled
    with pytest.raises(PathMapError, match="overlap"):
        _probed([[100], [100]]).validate()
    with pytest.raises(PathMapError, match="overlap or leave"):
        _probed([[99]]).validate()


def test_pathmap_from_probes_counts_unknown_routers():
    r = ProbeResult("10.0.1.1", 5201, "tcp", offenders={100: "172.16.0.1", 101: "172.16.2.1", 102: "9.9.9.9"})
    pm, unknown = pathmap_from_probes([r], {"172.16.0.1": 0, "172.16.2.1": 2}, src_ip="10.0.0.1", paths=4,
                                      port_range=(100, 199))
    assert pm.counts() == [1, 0, 1, 0] and unknown == 1 and pm.proto == 6


def test_probe_arguments_are_checked():
    with pytest.raises(ProbeError, match="^proto: "):
        probe_ports("10.0.0.1", 1, [1], proto="icmp")
    with pytest.raises(ProbeError, match="^ttl: "):
        probe_ports("10.0.0.1", 1, [1], ttl=0)


def test_sample_ports_is_seeded_and_distinct():
    a = sample_ports((20000, 29999), 128, 7)
    assert a == sample_ports((20000, 29999), 128, 7) and len(set(a)) == 128
    assert sample_ports((10, 19), 0, 1) == list(range(10, 20))
    assert 15 not in sample_ports((10, 19), 0, 1, exclude=[15])


class _Maps:
    def __init__(self, pm):
        self.pm = pm

    def __call__(self, src, dst, dport):
        return self.pm


def test_core_skips_paths_no_probed_port_reaches():
    fab = spine_leaf(leaves=2, spines=4, gpus_per_leaf=1)
    maps = _Maps(_probed([[], [110, 111], [], [120]]))
    core = ArkCore(0, fab, maps)
    d1 = core.request(1, 1000, 0.0, 5201)
    d2 = core.request(1, 1000, 0.0, 5201)
    assert (d1.path, d2.path) == (1, 3)
    d3 = core.request(1, 1000, 0.0, 5201)  # every usable path busy: ECMP over probed ports only
    assert d3.fallback and d3.port in (110, 111, 120) and not d3.reserved
    # A re-probed fabric: the live flow on path 1 now hashes to path 2.
    maps.pm = _probed([[], [111], [110], [120]])
    assert core.reload_pathmaps() == [d1.flow]
    assert PortBuckets(maps.pm).usable_mask == 0b1110


def test_testbed_commands_without_a_testbed_fail_in_one_line(tmp_path, capsys):
    from ark.cli import main

    assert main(["testbed", "run", "--state-dir", str(tmp_path), "--prefix", "nope"]) == 2
    e = capsys.readouterr().err.strip()
    assert e.startswith("ark: error: no testbed at") and "\n" not in e
    assert main(["testbed", "run", "--fail-link", "0-1", "--state-dir", str(tmp_path)]) == 2
    assert "--fail-link" in capsys.readouterr().err
    assert main(["testbed", "run", "--fail-link", "0:1@3:0.5", "--state-dir", str(tmp_path)]) == 2
    assert "cannot degrade" in capsys.readouterr().err
    for bad, why in (("nan", "is not a finite number"), ("0.5", "is not in the range")):
        assert main(["testbed", "run", "--engine", "vllm", "--vllm-poll-s", bad, "--state-dir", str(tmp_path)]) == 2
        e = capsys.readouterr().err.strip()
        assert "--vllm-poll-s" in e and why in e and "\n" not in e


# --------------------------------------------------------------------------- root
root = pytest.mark.root
needs_ns = pytest.mark.skipif(netns.available() is not None, reason=f"testbed: {netns.available()}")


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    from ark.testbed import fabric as tb

    base = str(tmp_path_factory.mktemp("tb"))
    tb.down("arkt", base)  # a crashed earlier run
    st = tb.up(tbm.TestbedSpec(**SMALL), base)
    yield st, base
    tb.down("arkt", base)


@root
@needs_ns
def test_up_builds_what_the_layout_says(bed):
    from ark.testbed.fabric import rtnl

    st, _ = bed
    lay = st.layout
    assert st.complete and all(netns.exists(n) for n in lay.namespaces())
    leaf = lay.leaf_ns(0)
    assert netns.read_sysctl(leaf, "net.ipv4.fib_multipath_hash_policy") == "3"
    assert netns.read_sysctl(leaf, "net.ipv4.fib_multipath_hash_seed") != "0"
    with rtnl(leaf) as ipr:
        routes = [r for r in ipr.get_routes(family=socket.AF_INET) if r.get_attr("RTA_MULTIPATH")]
        assert len(routes) == 1 and len(routes[0].get_attr("RTA_MULTIPATH")) == 4
        kinds = {ipr.get_links(ipr.link_lookup(ifname=f"s{k}")[0])[0].get_attr("IFLA_IFNAME"):
                 ipr.get_qdiscs(index=ipr.link_lookup(ifname=f"s{k}")[0])[0].get_attr("TCA_KIND") for k in range(4)}
    assert set(kinds.values()) == {"tbf"}
    # Data path across leaves, and the management network between agents' addresses.
    with netns.inside(lay.host_ns(2)):
        srv = socket.create_server((lay.host_ip(2), 5999))
        msrv = socket.create_server((lay.mgmt_ip(2), 5998))
    with netns.inside(lay.host_ns(0)):
        socket.create_connection((lay.host_ip(2), 5999), timeout=2).close()
        socket.create_connection((lay.mgmt_ip(2), 5998), timeout=2).close()
    srv.close()
    msrv.close()


@root
@needs_ns
def test_probes_agree_with_the_kernel_and_protocol_matters(bed):
    from ark.testbed.kernel import KernelRoutes

    st, _ = bed
    lay = st.layout
    ports = list(range(20000, 22000))
    dst = lay.host_ip(2)
    with netns.inside(lay.host_ns(0)):
        tcp = probe_ports(dst, 5201, ports, proto="tcp", src_ip=lay.host_ip(0))
        udp = probe_ports(dst, 5201, ports, proto="udp", src_ip=lay.host_ip(0))
    routers = lay.routers()
    kr = KernelRoutes(st, 0)
    try:
        kernel = {p: kr.spine(0, dst, p, 5201, 6) for p in ports}
        kernel_udp = {p: kr.spine(0, dst, p, 5201, 17) for p in ports}
    finally:
        kr.close()
    # UDP probes (RoCEv2's protocol) describe UDP routes exactly.
    assert sum(routers[o] == kernel_udp[p] for p, o in udp.offenders.items()) >= 0.999 * len(udp.offenders)
    assert len(tcp.offenders) >= 0.999 * len(ports)
    agree = sum(routers[o] == kernel[p] for p, o in tcp.offenders.items())
    assert agree / len(tcp.offenders) >= 0.999
    assert sorted(set(kernel.values())) == [0, 1, 2, 3]
    # UDP probes describe UDP flows: the protocol is hashed, so they miss TCP paths ~3/4 of the time.
    cross = sum(routers[o] == kernel[p] for p, o in udp.offenders.items()) / len(udp.offenders)
    assert cross < 0.5


@root
@needs_ns
def test_policy_1_follows_the_socket_hash_not_the_5tuple(bed):
    from ark.testbed.kernel import KernelRoutes

    st, _ = bed
    lay = st.layout
    leaf = lay.leaf_ns(0)
    ports = list(range(23000, 23400))
    netns.sysctl(leaf, "net.ipv4.fib_multipath_hash_policy", 1)
    try:
        with netns.inside(lay.host_ns(0)):
            tcp = probe_ports(lay.host_ip(2), 5201, ports, proto="tcp", src_ip=lay.host_ip(0))
        kr = KernelRoutes(st, 0)
        try:
            agree = sum(lay.routers()[o] == kr.spine(0, lay.host_ip(2), p, 5201, 6) for p, o in tcp.offenders.items())
        finally:
            kr.close()
    finally:
        netns.sysctl(leaf, "net.ipv4.fib_multipath_hash_policy", 3)
    assert agree / len(tcp.offenders) < 0.6  # the sender's random sk_txhash picks the spine


@root
@needs_ns
def test_link_down_rehashes_and_reprobing_follows(bed):
    from ark.agent import cluster as clmod
    from ark.agent.probe import check
    from ark.testbed import fabric as tb
    from ark.testbed import plan, probing

    st, _ = bed
    pairs = {0: {2, 3}, 1: {2, 3}}
    cfile = plan.cluster_file(st, "ark", 2.0, 64)
    probing.probe(st, pairs, 64, cfile)
    cl = clmod.load(cfile)
    host0 = st.layout.host_ns(0)
    with netns.inside(host0):  # where gpu0's agent runs its checks
        assert check(cl, "gpu0") == ([], 2 * 16)  # 4 ports x 4 paths x 2 peers, all still true
    tb.set_link(st, 0, 1, False)
    try:
        with netns.inside(host0):
            changed, _ = check(cl, "gpu0")
        assert changed == ["gpu2", "gpu3"]  # the leaf re-hashed: the periodic check sees it
        info = probing.probe(st, pairs, 64)
        assert info["probe_agreement_fraction"] >= 0.999
        pm = PathMap.load(st.dir / "maps" / "gpu0__gpu2__5201.json")
        assert pm.counts()[1] == 0 and min(pm.counts()[k] for k in (0, 2, 3)) >= 4
        assert State.load(st.dir).down_links == [(0, 1)]
    finally:
        tb.set_link(st, 0, 1, True)
    assert probing.probe(st, pairs, 64)["probe_agreement_fraction"] >= 0.999
    assert PathMap.load(st.dir / "maps" / "gpu0__gpu2__5201.json").counts()[1] > 0


@root
@needs_ns
def test_small_run_ark_flows_cross_their_reserved_spines(bed):
    from ark.testbed import run as tr

    st, _ = bed
    ark = tr.run(st, tr.RunParams(scheme="ark", requests=16, qps=8.0, seed=1, sample=64))
    assert ark["errors"] == 0 and len(ark["flows"]) == 16
    assert ark["path_checked"] == 16 and ark["path_match_fraction"] == 1.0
    assert ark["probe_agreement_fraction"] >= 0.999 and ark["probes_sent"] >= 2 * 64
    assert all(f["fct_s"] > 0 and f["spine"] == f["reserved_spine"] and len(f["segments"]) == 1 for f in ark["flows"])
    ecmp = tr.run(st, tr.RunParams(scheme="ecmp", requests=16, qps=8.0, seed=1, sample=64), reprobe=False)
    assert ecmp["errors"] == 0 and ecmp["path_match_fraction"] is None
    assert sum(ecmp["flows_per_spine"]) == 16  # counters saw every flow on some spine
    # Same plan, same bytes: only the paths differ.
    assert [f["bytes"] for f in ecmp["flows"]] == [f["bytes"] for f in ark["flows"]]


@root
@needs_ns
def test_ark_split_flows_send_on_every_part_each_across_its_own_spine(bed):
    from ark.testbed import run as tr

    st, _ = bed
    rec = tr.run(st, tr.RunParams(scheme="ark-split", requests=12, qps=8.0, seed=2, sample=64), reprobe=False)
    assert rec["errors"] == 0 and rec["path_checked"] == 12 and rec["path_match_fraction"] == 1.0
    assert rec["sim"]["fct_mean_s"] > 0  # the simulator's ark-split over the same flows
    part_bytes = round(ClusterSettings().split_part_bytes * st.spec.scale)  # scaled like the flows
    for f in rec["flows"]:
        segs, n = f["segments"], min(4, -(-f["bytes"] // part_bytes))
        # The agent's choice: one part per split_part_bytes, at most one per spine, each its
        # own connection from a port of its own path; together they carry the bytes once.
        assert len(segs) == n and sorted(sg["part"] for sg in segs) == list(range(n))
        assert len({sg["path"] for sg in segs}) == n and len({sg["sport"] for sg in segs}) == n
        assert all(set(sg["spine_bytes"]) == {str(sg["path"])} for sg in segs if sg["bytes"])
        assert sum(sg["bytes"] for sg in segs) == f["bytes"]


@root
@needs_ns
def test_under_arbiters_ark_split_flows_cross_their_reserved_spines(bed):
    from ark.testbed import run as tr

    st, _ = bed
    rec = tr.run(st, tr.RunParams(scheme="ark-split", requests=12, qps=8.0, seed=2, sample=64, control="arbiter"),
                 reprobe=False)
    assert rec["control"] == "arbiter" and rec["errors"] == 0
    assert rec["path_checked"] == 12 and rec["path_match_fraction"] == 1.0
    logs = sorted((st.dir / "run-builtin-ark-split-2").glob("arbiter-*.log"))
    assert len(logs) == 2  # a primary and a standby, in two hosts' namespaces
    with pytest.raises(tr.TestbedError, match="control: must be one of broadcast, arbiter"):
        tr.RunParams(control="central").check(st)


@root
@needs_ns
def test_a_seed_fixes_ecmp_paths_and_the_run_records_where_its_time_went(bed):
    from ark.testbed import run as tr

    st, _ = bed
    p = tr.RunParams(scheme="ecmp", requests=12, qps=8.0, seed=3, sample=64)
    a, b = tr.run(st, p), tr.run(st, p, reprobe=False)
    assert [(f["sport"], f["spine"]) for f in a["flows"]] == [(f["sport"], f["spine"]) for f in b["flows"]]
    assert a["paths_digest"] == b["paths_digest"] and a["hash_keys"] == b["hash_keys"]
    other = tr.run(st, tr.RunParams(scheme="ecmp", requests=12, qps=8.0, seed=4, sample=64))
    assert other["hash_keys"] != a["hash_keys"] and other["paths_digest"] != a["paths_digest"]
    assert 0.0 < a["cpu_busy_fraction"] <= 1.0 and isinstance(a["cpu_saturated"], bool)
    for f in a["flows"]:
        parts = [f[k] for k in tr.PARTS]
        assert f["lease_s"] == 0.0 and sum(parts) == pytest.approx(f["fct_s"], abs=1e-3)


def test_runs_interleave_schemes_across_seeds():
    from ark.testbed.run import interleaved

    order = interleaved([0, 1, 2], ["ecmp", "ark", "ark-balance"])
    assert order[:3] == [(0, "ecmp"), (0, "ark"), (0, "ark-balance")]
    assert order[3:6] == [(1, "ark"), (1, "ark-balance"), (1, "ecmp")]
    assert [sc for _, sc in order[6:]] == ["ark-balance", "ecmp", "ark"]


def test_ecmp_ports_are_seeded_distinct_per_host_and_in_the_ephemeral_range():
    from ark.core.flows import FlowSpec
    from ark.testbed.plan import EPHEMERAL, ecmp_ports

    flows = [FlowSpec(i, i % 3, 8, 10, 0.0) for i in range(30)]
    a, b, c = ecmp_ports(flows, 1), ecmp_ports(flows, 1), ecmp_ports(flows, 2)
    assert a == b != c and set(a) == set(range(30))
    assert all(EPHEMERAL[0] <= p <= EPHEMERAL[1] for p in a.values())
    for src in range(3):
        ports = [a[f.id] for f in flows if f.src == src]
        assert len(set(ports)) == len(ports)


@root
@needs_ns
def test_cli_run_json_keys_and_fabric_change(bed, capsys):
    from ark.cli import main

    st, base = bed
    rc = main(["testbed", "run", "--seeds", "1", "--requests", "24", "--qps", "6", "--scheme", "ark", "--sample", "64",
               "--fail-link", "0:2@1.0", "--prefix", "arkt", "--state-dir", base, "--json"])
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)
    for key in ("scheme", "flows", "fct_mean_s", "fct_p95_s", "path_match_fraction", "probe_agreement_fraction",
                "probes_sent"):
        assert key in rec
    ch = rec["fabric_change"]
    assert ch["probe_agreement_fraction"] >= 0.999 and ch["flows_after_refresh"] > 0
    assert ch["path_match_after_refresh"] == 1.0
    # Both source agents noticed the re-hash by their periodic checks (or were told to refresh).
    assert len(ch["detected_at_s"]) + len(ch["told_to_refresh"]) == 2 and ch["detected_at_s"]
    assert all(ch["failing_at_s"] < t < ch["failing_at_s"] + 10 for t in ch["detected_at_s"].values())
    after = [f for f in rec["flows"] if f["start_s"] > ch["refreshed_at_s"]]
    assert all(f["reserved_spine"] != 2 for f in after)  # no probed port reaches spine 2 any more
    assert State.load(st.dir).down_links == []  # the run brought the link back


@root
@needs_ns
def test_down_removes_everything_even_after_a_crash(tmp_path):
    from pyroute2 import netns as pnetns

    from ark.testbed import fabric as tb

    base = str(tmp_path)
    # A crash before the state file listed anything: names with the prefix are still found.
    pnetns.create("arkc-gpu0")
    pnetns.create("arkc-spine3")
    pnetns.create("arkc-other")  # not a testbed name: left alone
    try:
        p = netns.spawn("arkc-gpu0", ["sleep", "30"])
        removed = tb.down("arkc", base)
        assert sorted(removed) == ["arkc-gpu0", "arkc-spine3"]
        assert p.wait(5) is not None  # processes inside were killed
        assert netns.exists("arkc-other")
        assert tb.down("arkc", base) == []  # idempotent
        # A full build and teardown leaves nothing behind.
        st = tb.up(tbm.TestbedSpec(leaves=2, spines=2, gpus_per_leaf=1, prefix="arkc"), base)
        assert all(netns.exists(n) for n in st.namespaces)
        with pytest.raises(tbm.TestbedError, match="exists"):
            tb.up(tbm.TestbedSpec(leaves=2, spines=2, gpus_per_leaf=1, prefix="arkc"), base)
        tb.down("arkc", base)
        assert netns.listed("arkc-") == ["arkc-other"] and not os.path.exists(os.path.join(base, "arkc"))
    finally:
        pnetns.remove("arkc-other")
        tb.down("arkc", base)


def test_cluster_probe_keys_are_checked(tmp_path):
    from ark.agent.cluster import ClusterError, from_dict

    base = {"fabric": {"preset": "paper"},
            "hosts": [{"name": "gpu0", "control": "tcp://10.9.0.1:7100", "api": "ipc:///tmp/a.sock",
                       "public_key": "x" * 40}]}
    with pytest.raises(ClusterError, match="^cluster.routers_file: needs pathmap_dir"):
        from_dict({**base, "cluster": {"routers_file": "r.json"}})
    with pytest.raises(ClusterError, match="^cluster.probe_proto: must be one of udp, tcp"):
        from_dict({**base, "cluster": {"probe_proto": "icmp"}})
    c = from_dict({**base, "cluster": {"pathmap_dir": "m", "routers_file": "r.json", "probe_sample": 0}}, tmp_path)
    assert c.routers_file == str(tmp_path / "r.json") and c.probe_sample == 0 and c.probe_proto == "udp"


def test_routers_file_errors_are_one_line(tmp_path):
    from ark.agent.probe import load_routers

    (tmp_path / "r.json").write_text("[1, 2]")
    with pytest.raises(ProbeError, match="^routers_file: .* must be a JSON object"):
        load_routers(str(tmp_path / "r.json"))
    (tmp_path / "r.json").write_text('{"172.16.0.1": 0}')
    assert load_routers(str(tmp_path / "r.json")) == {"172.16.0.1": 0}


def test_spec_from_an_experiment_config(tmp_path):
    from ark.sim import config as cfgmod

    (tmp_path / "f.toml").write_text("[fabric]\nleaves = 3\nspines = 2\ngpus_per_leaf = 4\nlink_gbps = 400\n")
    spec = tbm.TestbedSpec.from_fabric_config(cfgmod.load(tmp_path / "f.toml").fabric, prefix="x")
    assert (spec.leaves, spec.spines, spec.gpus_per_leaf, spec.link_gbps, spec.prefix) == (3, 2, 4, 400.0, "x")
    assert len(Layout(spec).namespaces()) == 1 + 2 + 3 + 12
    assert spec.scaled_fabric().link_bps == pytest.approx(4e8)


def test_up_without_root_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(tbm.TestbedError, match="^testbed: needs root"):
        tbm.up(tbm.TestbedSpec(prefix="nr"), str(tmp_path))


def test_damaged_state_file_is_one_line(tmp_path):
    d = tmp_path / "ark"
    d.mkdir()
    (d / "state.json").write_text('{"spec": {"leaves": 2}}')
    with pytest.raises(tbm.TestbedError, match="is damaged .*ark testbed down"):
        State.load(d)


def test_learn_with_nothing_to_probe_is_a_clear_error():
    from ark.agent.probe import learn

    with pytest.raises(ProbeError, match="^port_range: no source port"):
        learn("10.0.1.1", 5201, {}, src_ip="10.0.0.1", paths=4, port_range=(100, 101), exclude=[100, 101])
