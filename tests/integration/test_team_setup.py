"""The team setup (README "Team setup"): docker-compose.yml's services, ports, images and build references
parse and agree with the README's environment and commands, and with the Dockerfile. (No containers run on
these machines: this checks the files, not a running stack.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from mergepipe_db.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
SERVICES = {"postgres", "s3", "scheduler", "worker-1", "worker-2", "mergepipe"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def section() -> str:
    readme = (REPO / "README.md").read_text()
    m = re.search(r"^## Team setup\n(.*?)(?=^## )", readme, re.S | re.M)
    assert m, "README has no 'Team setup' section"
    return m.group(1)


def _env(section: str) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(\S+)$", section, re.M))


def _commands(section: str) -> list[list[str]]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        out += [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    return [c for c in out if c]


def _published(service: dict) -> dict[int, int]:
    """container port -> host port"""
    out = {}
    for p in service.get("ports", []):
        host, _, container = str(p).rpartition(":")
        out[int(container)] = int(host)
    return out


def _env_of(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    return dict(env) if isinstance(env, dict) else dict(e.split("=", 1) for e in env)


def test_services_images_builds_and_healthchecks(compose) -> None:
    services = compose["services"]
    assert set(services) == SERVICES
    for name in SERVICES - {"mergepipe"}:  # the CLI runs once, on demand (profile "cli")
        hc = services[name]["healthcheck"]["test"]
        assert hc[0] in ("CMD", "CMD-SHELL") and len(hc) > 1, name
    assert services["mergepipe"]["profiles"] == ["cli"]
    # one service builds the repo's Dockerfile; the Dask services and the CLI run that image
    built = {n: s for n, s in services.items() if "build" in s}
    assert list(built) == ["scheduler"] and built["scheduler"]["build"] == "."
    image = built["scheduler"]["image"]
    for name in ("worker-1", "worker-2", "mergepipe"):
        assert services[name]["image"] == image and "build" not in services[name]
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["s3"]["image"].startswith("chrislusf/seaweedfs:")
    assert services["s3"]["command"][0] == "mini"
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+", dockerfile, re.M)
    assert "torch==2.13.0" in dockerfile and "download.pytorch.org/whl/cpu" in dockerfile
    assert re.search(r'pip install "\.\[postgres\]"', dockerfile)
    for src in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in src.split():
            assert (REPO / path).exists(), f"Dockerfile copies {path}, which the repo does not have"
    # what the image installs is what runs: the Dask commands come from the project's dependencies
    deps = (REPO / "pyproject.toml").read_text()
    assert '"dask' in deps and '"distributed' in deps
    for name in ("scheduler", "worker-1", "worker-2"):
        assert services[name]["command"][0] == "dask"


def test_workers_reach_scheduler_and_store(compose) -> None:
    services = compose["services"]
    sched_port = int(services["scheduler"]["command"][services["scheduler"]["command"].index("--port") + 1])
    s3_env = _env_of(services["s3"])
    for name in ("worker-1", "worker-2"):
        w = services[name]
        assert w["command"][:3] == ["dask", "worker", f"tcp://scheduler:{sched_port}"]
        assert w["command"][w["command"].index("--name") + 1] == name
        env = _env_of(w)
        assert env["AWS_ENDPOINT_URL"] == "http://s3:8333"
        assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (s3_env["AWS_ACCESS_KEY_ID"],
                                                                             s3_env["AWS_SECRET_ACCESS_KEY"])
        assert set(w["depends_on"]) == {"scheduler", "s3"}
        # the workers see the coordinator's local outputs at the same place
        assert set(w["volumes"]) & set(services["mergepipe"]["volumes"])
    pg = _env_of(services["postgres"])
    url = urlsplit(_env_of(services["mergepipe"])["MERGEPIPE_CATALOG"].replace("postgresql+psycopg", "pg"))
    assert (url.username, url.password, url.hostname, url.port, url.path.lstrip("/")) == (
        pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], "postgres", 5432, pg["POSTGRES_DB"])


def test_readme_environment_agrees_with_compose(compose, section) -> None:
    services = compose["services"]
    env = _env(section)
    assert set(env) == {"MERGEPIPE_CATALOG", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                        "AWS_REGION"}
    pg, s3 = _env_of(services["postgres"]), _env_of(services["s3"])
    url = urlsplit(env["MERGEPIPE_CATALOG"])
    assert url.scheme == "postgresql+psycopg"
    assert (url.username, url.password, url.hostname, url.path.lstrip("/")) == (
        pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], "localhost", pg["POSTGRES_DB"])
    assert _published(services["postgres"])[5432] == url.port
    endpoint = urlsplit(env["AWS_ENDPOINT_URL"])
    assert endpoint.scheme == "http" and endpoint.hostname == "localhost"
    assert _published(services["s3"])[8333] == endpoint.port
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (s3["AWS_ACCESS_KEY_ID"],
                                                                        s3["AWS_SECRET_ACCESS_KEY"])
    assert env["AWS_REGION"] == "us-east-1"
    assert f"--storage-option endpoint={env['AWS_ENDPOINT_URL']}" in section
    # the scheduler's port and dashboard as the README gives them
    ports = _published(services["scheduler"])
    assert f"tcp://localhost:{ports[8786]}" in section and f"http://localhost:{ports[8787]}" in section


def test_readme_commands_parse_and_name_what_compose_has(compose, section) -> None:
    services = compose["services"]
    buckets = set(next(a for a in services["s3"]["command"] if a.startswith("-bucket=")).split("=", 1)[1]
                  .split(","))
    commands = _commands(section)
    assert ["docker", "compose", "up", "-d", "--build", "--wait"] in commands
    ingests = [c for c in commands if c[:2] == ["mergepipe", "ingest"]]
    runs = [c for c in commands if c[:4] == ["docker", "compose", "run", "--rm"]]
    assert len(ingests) >= 2 and len(runs) == 1
    parser = build_parser()
    names = set()
    for c in ingests:
        args = parser.parse_args(c[1:])
        [path], [name] = args.path, args.name
        uri = urlsplit(path)
        assert uri.scheme == "s3" and uri.netloc in buckets and uri.path.strip("/")
        names.add(name)
    [run] = runs
    assert run[4] == "mergepipe" and services["mergepipe"]["entrypoint"] == ["mergepipe"]
    args = parser.parse_args(run[5:])
    assert args.func.__name__ == "cmd_merge"
    sched = urlsplit(args.scheduler)
    assert (sched.scheme, sched.hostname, sched.port) == ("tcp", "scheduler", 8786)
    # --out and the spec on the volumes the CLI service mounts (the workers share the output one)
    mounts = {v.split(":")[1] for v in services["mergepipe"]["volumes"]}
    assert any(args.out.startswith(m + "/") for m in mounts) and any(args.spec.startswith(m + "/") for m in mounts)
    assert "base" in names
