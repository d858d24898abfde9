"""benchmarks/load.py's soak, briefly: random lengths, cancellations and deadlines over
gRPC end with nothing lost or failed, every page free and the server healthy."""

import json

import pytest


@pytest.mark.slow
def test_a_short_soak_loses_nothing_and_returns_every_page(tmp_path):
    from benchmarks.load import main

    out = tmp_path / "soak.json"
    status = main(["--soak", "8", "--clients", "6", "--json", str(out)])
    row = json.loads(out.read_text())["results"][0]
    assert status == 0, row
    assert row["completed"] > 0 and row["cancelled"] > 0
    assert row["lost"] == 0 and row["failed"] == 0 and row["requests_left"] == 0
    assert row["pages_free_end"] == row["pages_free_start"]
    assert row["healthy_after"]
