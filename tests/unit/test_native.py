"""kvc.native: which twin runs, and what an operator is told when it is the Python one."""

from __future__ import annotations

import logging

import pytest

from kvc import native


def test_nothing_is_logged_when_the_compiled_module_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "AVAILABLE", True)
    native.log_if_missing(logging.getLogger("t"))
    assert caplog.records == []


@pytest.mark.parametrize(
    ("switch", "reason"), [("0", "KVC_NATIVE=0"), ("", "was not built"), ("off", "KVC_NATIVE=0")]
)
def test_the_python_twins_are_named_with_the_reason(
    switch: str, reason: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "AVAILABLE", False)
    monkeypatch.setenv("KVC_NATIVE", switch)
    with caplog.at_level(logging.WARNING):
        native.log_if_missing(logging.getLogger("t"))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "pure Python" in record.getMessage()
    assert reason in record.getMessage()
