import pytest

from openglm.agent.task import ConstraintError, parse_constraints, parse_duration, parse_resource


def test_write_up_constraints_parse():
    c = parse_constraints({"timeout": "8h", "resource": "16CPU/64GB", "deliverables": ["ISO镜像", "安装脚本"]})
    assert c.timeout_s == 8 * 3600
    assert c.resources.cpus == 16 and c.resources.memory_bytes == 64 * 2**30
    assert [d.path for d in c.deliverables] == ["ISO镜像", "安装脚本"]


@pytest.mark.parametrize("text,seconds", [("90m", 5400), ("1h30m", 5400), ("45s", 45), ("2d", 172800), (30, 30)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("raw,field", [
    ({"timeout": "8 parsecs"}, "constraints.timeout"),
    ({"timeout": "soon"}, "constraints.timeout"),
    ({"timeout": -5}, "constraints.timeout"),
    ({"resource": "16 bananas"}, "constraints.resource"),
    ({"resource": "0CPU"}, "constraints.resource"),
    ({"deliverables": "ISO"}, "constraints.deliverables"),
    ({"deliverables": [{"url": "x"}]}, "constraints.deliverables[0]"),
    ({"budget": "10$"}, "constraints.budget"),
    ({"max_steps": 0}, "constraints.max_steps"),
])
def test_bad_constraints_name_the_field(raw, field):
    with pytest.raises(ConstraintError) as e:
        parse_constraints(raw)
    assert e.value.field == field


def test_resource_parts():
    r = parse_resource("2cpu/512MB")
    assert (r.cpus, r.memory_bytes) == (2, 512 * 2**20)
    assert parse_resource("4CPU").memory_bytes is None


def test_deliverable_commands():
    c = parse_constraints({"deliverables": [{"command": "pytest -q"}, {"path": "out.iso"}]})
    assert c.deliverables[0].command == "pytest -q" and c.deliverables[1].path == "out.iso"
