"""The ``remote_device`` grammar of RemoteModule: a pure function, tested with plain strings."""

from __future__ import annotations

import pytest

from nbremote.nn._device import RemoteDevice, RemoteDeviceError, parse_remote_device


@pytest.mark.parametrize(
    ("text", "worker", "device"),
    [
        ("worker1/cuda:0", "worker1", "cuda:0"),
        ("worker1/cpu", "worker1", "cpu"),
        ("worker1", "worker1", "cpu"),
        ("rank:1/cpu", 1, "cpu"),
        ("rank:12", 12, "cpu"),
        ("rank:0/cuda", 0, "cuda"),
        ("gpu-box_2/cuda:3", "gpu-box_2", "cuda:3"),
        ("w/cuda:01", "w", "cuda:1"),
    ],
)
def test_accepted_forms(text: str, worker: str | int, device: str) -> None:
    assert parse_remote_device(text) == RemoteDevice(worker, device)


@pytest.mark.parametrize(
    "text",
    [
        "a/b/c",
        "/",
        "/cpu",
        "w/",
        "w/cpu2",
        "w/foo",
        "",
        "rank:x/cpu",
        "rank:-1",
        "rank:",
        "w/cuda:",
        "w/cuda:x",
        "w/CPU",
        "my worker/cpu",
        "w/cpu:0",
    ],
)
def test_malformed_strings_raise_value_error_naming_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="malformed remote_device") as info:
        parse_remote_device(text)
    message = str(info.value)
    assert repr(text) in message
    assert '"<worker>/<device>"' in message and '"rank:<N>/<device>"' in message


def test_non_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="must be a str"):
        parse_remote_device(1)  # type: ignore[arg-type]


def test_device_parts_and_str() -> None:
    place = parse_remote_device("rank:2/cuda:1")
    assert (place.device_type, place.device_index, str(place)) == ("cuda", 1, "rank:2/cuda:1")
    cpu = parse_remote_device("worker1")
    assert (cpu.device_type, cpu.device_index, str(cpu)) == ("cpu", None, "worker1/cpu")
    assert parse_remote_device("w/cuda").device_index is None


def test_remote_device_error_is_a_value_error_that_names_the_worker() -> None:
    err = RemoteDeviceError("worker1 has no CUDA device", worker="worker1")
    assert isinstance(err, ValueError)
    assert err.worker == "worker1"
