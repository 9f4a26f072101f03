"""NOTE [ Plan search ] rule 2: the activation candidates' front is over device (forward's end and
backward's), host and NVMe bytes and time, so a host too small for offloading to the host still gets the NVMe plans."""

from __future__ import annotations

import importlib

from tests.test_planner import MiB, synthetic

search_module = importlib.import_module("tiermem.planner.search")


def test_a_small_host_takes_the_nvme_policy_that_host_offload_beats_on_device_and_time():
    # Host copies at 10 GB/s against a 1 GB/s disk: on device bytes and time, "host" beats
    # "nvme" for every block, so a front over those two alone holds no NVMe entry.
    profile = synthetic(8, saved=64 * MiB, memcpy=10e9, nvme=1e9, forward_s=0.05)
    acts = search_module.activation_candidates(profile)
    host_all = next(a for a in acts if a.policies == ("host",) * 8)
    nvme_all = next(a for a in acts if a.policies == ("nvme",) * 8)
    assert host_all.device <= nvme_all.device and host_all.time < nvme_all.time
    assert nvme_all.host < host_all.host
    front = search_module.pareto(acts)
    assert any("nvme" in a.policies for a in front)

    def point(a):  # backward's device bytes too: they sit beside the gradients in flight
        return (a.device, a.host, a.nvme, a.time, a.backward)

    for a in front:  # nothing on the front is beaten everywhere by another candidate
        assert not any(
            point(b) != point(a) and all(x <= y for x, y in zip(point(b), point(a), strict=True)) for b in acts
        )
    # Room on the device for a block or two of activations beside the model states, 8 MiB of
    # host (no block's 64 MiB fits there) and plenty of NVMe: only NVMe offload can fit.
    states = 16 * sum(p.nbytes for p in profile.params)
    caps = {"device": states + 200 * MiB, "host": 8 * MiB, "nvme": 4 << 30}
    decision = search_module.search(profile, caps)
    assert "nvme" in decision.plan.block_policy and "host" not in decision.plan.block_policy
    peaks = decision.plan.predicted.peak_bytes
    assert peaks["host"] <= caps["host"] and peaks["device"] <= caps["device"]
