"""The run report (purrsight/observability/report.py): what a report killed half way leaves behind."""

from __future__ import annotations

from pathlib import Path

from purrsight.atomic_file import stale_temp_files
from purrsight.observability.report import write_report
from tests.helpers import killed_mid_publish


def test_the_temp_files_of_a_report_killed_half_way_are_removed_by_the_next_report(tmp_path: Path) -> None:
    """Killed while it wrote report.md and attempts.png, a run left their temp files for good."""
    (tmp_path / "report.md").write_text("# the last whole report\n")
    torn = [killed_mid_publish(tmp_path / "report.md"), killed_mid_publish(tmp_path / "attempts.png")]
    assert (tmp_path / "report.md").read_text() == "# the last whole report\n"  # the kill left the old one
    report = write_report(tmp_path)
    assert not any(path.exists() for path in torn) and stale_temp_files(tmp_path) == []
    assert report.read_text().startswith(f"# Run report: {tmp_path.name}\n")
