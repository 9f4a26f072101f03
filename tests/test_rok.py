"""``tiermem rok`` at a tiny size: a CSV row per (policy, batch size) and a PNG plot."""

from __future__ import annotations

import csv
import json

from tiermem.cli import main


def test_rok_writes_csv_and_png(tmp_path, capsys, monkeypatch):
    config = tmp_path / "tiers.toml"
    disk = tmp_path / "disk"
    disk.mkdir()
    config.write_text(
        f'[device]\ndevice = "cpu"\ncapacity = "256MiB"\n[host]\ncapacity = "256MiB"\n'
        f'[nvme]\npaths = ["{disk}"]\ncapacity = "1GiB"\n[activations]\nmin_bytes = "4KiB"\n'
    )
    out = tmp_path / "curve"
    code = main(
        [
            "rok",
            "--config",
            str(config),
            "--batch-sizes",
            "1,2",
            "--steps",
            "1",
            "--layers",
            "4",
            "--d-model",
            "32",
            "--heads",
            "2",
            "--vocab",
            "64",
            "--seq-len",
            "32",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    with out.with_suffix(".csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(report["points"]) == 8
    assert {(r["policy"], r["batch_size"]) for r in rows} == {
        (p, b) for p in ("keep", "recompute", "host", "nvme") for b in ("1", "2")
    }
    assert all(float(r["step_s"]) > 0 for r in rows)
    by = {(r["policy"], int(r["batch_size"])): int(r["peak_activation_bytes"]) for r in rows}
    assert by[("keep", 2)] > by[("keep", 1)] > 0  # more batch, more activations kept
    assert by[("recompute", 2)] < by[("keep", 2)]  # recompute keeps only block inputs
    # nvme offloads what it captured; writes that backward overtook are cancelled, not written,
    # so how many land in a step of this tiny model is timing (a fresh-clone run saw none land
    # at batch 1): written bytes are bounded by the captured ones, never more.
    nvme_rows = [r for r in rows if r["policy"] == "nvme"]
    assert all(int(r["captured_bytes_per_step"]) > 0 for r in nvme_rows), rows
    assert all(0 <= int(r["nvme_written_per_step"]) <= int(r["captured_bytes_per_step"]) for r in nvme_rows), rows
    assert all(int(r["nvme_written_per_step"]) == 0 for r in rows if r["policy"] != "nvme"), rows
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(disk.iterdir()) == []


def test_rok_rejects_bad_batch_sizes(capsys):
    try:
        main(["rok", "--batch-sizes", "0,x"])
    except SystemExit as exit_:
        assert exit_.code != 0
    assert "expected" in capsys.readouterr().err


def test_rok_refuses_a_model_shape_that_is_not_positive(capsys):
    """rok takes the GPT's shape as train does: a zero is refused at the command line."""
    assert main(["rok", "--layers", "0"]) == 2
    assert "argument --layers: 0 must be at least 1" in capsys.readouterr().err
