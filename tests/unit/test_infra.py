"""infra/: every file parses and validates; prefect.yaml declares exactly what deployments.py serves;
the compose stack holds no secret, publishes only on an explicit (loopback by default) address, and
wires every secret from a file; the helper scripts do what the stack relies on."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import re
import shlex
import stat
import subprocess
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptflow.policy.config import PrefectConfig, S3TierConfig, load_config
from ckptflow.policy.drill_spec import load_drill_spec
from ckptflow.policy.retention_schema import load_retention_policy

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
YAML_FILES = ["prefect.yaml", "compose.yaml", "ckptflow.prod.yaml", "retention.yaml", "drill.yaml"]
SECRET_WORD = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|AUTH|CREDENTIAL|ACCESS_KEY|PRIVATE", re.IGNORECASE)
REFERENCE = re.compile(r"^\$?\$\{[A-Za-z_][A-Za-z0-9_]*(:?[-?][^}]*)?\}$")  # ${VAR}, ${VAR:-x}, $${VAR}
URL_USERINFO = re.compile(r"[a-z][a-z0-9+.-]*://([^/@\s:]+):([^/@\s]*)@", re.IGNORECASE)
LOOPBACK_DEFAULT = "${CKPTFLOW_BIND_ADDRESS:-127.0.0.1}:"
CONFIG_DIR_VAR = "CKPTFLOW_CONFIG_DIR"


def _load(name: str) -> Any:
    return yaml.safe_load((INFRA / name).read_text())


@pytest.mark.parametrize("name", YAML_FILES)
def test_every_infra_yaml_file_parses(name: str) -> None:
    assert isinstance(_load(name), dict), name


# ------------------------------------------------------------------------- ckptflow's own schemas
def test_the_production_config_validates_and_holds_no_secret() -> None:
    from sqlalchemy.engine import make_url

    config = load_config(INFRA / "ckptflow.prod.yaml")
    assert make_url(config.catalog).password is None  # libpq reads PGPASSWORD / PGPASSFILE instead
    assert make_url(config.catalog).get_backend_name() == "postgresql"
    assert config.tier_names() == ["hot", "warm", "cold"]
    cold = config.tiers["cold"]
    assert isinstance(cold, S3TierConfig) and cold.credentials_env and cold.credentials_file is None
    assert config.prefect.api_url and "@" not in config.prefect.api_url
    assert config.prefect.work_pool == PrefectConfig().work_pool == "ckptflow"


def test_the_retention_policy_validates() -> None:
    policy = load_retention_policy(INFRA / "retention.yaml")
    assert [name for name, _ in policy.tiers.items()] == ["hot", "warm", "cold"]
    # the tiers it prices are the production config's, at the same prices
    config = load_config(INFRA / "ckptflow.prod.yaml")
    for name, tier in policy.tiers.items():
        assert tier.price.per_gb_month == config.tiers[name].price_per_gb_month, name


def test_the_drill_spec_validates_and_names_a_real_entry_point_of_train_tiny() -> None:
    spec = load_drill_spec(INFRA / "drill.yaml")
    assert spec.tier == "cold" and spec.run == "tiny"
    module, function = spec.eval.split(":")
    # python_path is where infra/Dockerfile copies examples/: the module must be there
    assert spec.python_path == ["/opt/ckptflow/examples"]
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert "WORKDIR /opt/ckptflow" in dockerfile and "COPY examples ./examples" in dockerfile
    source = REPO / "examples" / f"{module}.py"
    tree = ast.parse(source.read_text())
    (entry,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    accepted = {a.arg for a in entry.args.args[1:] + entry.args.kwonlyargs}
    assert set(spec.eval_kwargs) <= accepted, (spec.eval_kwargs, accepted)
    # the run it drills is train_tiny's default --hidden/--seed: the recorded eval_loss is comparable
    defaults = {
        node.args[0].value: kw.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
        for kw in node.keywords
        if kw.arg == "default"
        and isinstance(kw.value, ast.Constant)
        and isinstance(node.args[0], ast.Constant)
    }
    assert (defaults["--hidden"], defaults["--seed"]) == (
        spec.eval_kwargs["hidden"],
        spec.eval_kwargs["seed"],
    )


# ------------------------------------------------------------------- prefect.yaml == deployments.py
def _rendered_prefect_yaml(config_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """prefect.yaml with {{ $VAR }} placeholders filled exactly as `prefect deploy` fills them."""
    from prefect.utilities.templating import apply_values

    monkeypatch.setenv(CONFIG_DIR_VAR, str(config_dir))
    return apply_values(_load("prefect.yaml"), dict(os.environ), remove_notset=False)


def test_prefect_yaml_uses_only_the_documented_environment_variable() -> None:
    text = (INFRA / "prefect.yaml").read_text()
    assert set(re.findall(r"\{\{\s*\$([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", text)) == {CONFIG_DIR_VAR}
    assert set(re.findall(r"\$([A-Z_][A-Z0-9_]*)", text)) == {CONFIG_DIR_VAR}


def test_prefect_yaml_declares_exactly_the_deployments_of_deployments_py(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.events import DeploymentTriggerTypes
    from prefect.flows import load_flow_from_entrypoint
    from pydantic import TypeAdapter

    from ckptflow.flows.deployments import deployments

    config_dir = tmp_path.resolve()
    project = _rendered_prefect_yaml(config_dir, monkeypatch)
    assert "{{ $" not in json.dumps(project)
    assert project["pull"] == []  # the worker imports the installed package; nothing is pulled
    expected = {d.name: d for d in deployments(str(config_dir / "ckptflow.yaml"))}
    declared = {d["name"]: d for d in project["deployments"]}
    assert set(declared) == set(expected)
    triggers = TypeAdapter(DeploymentTriggerTypes)
    for name, want in expected.items():
        got = declared[name]
        # module entrypoints (importable by the worker and by Dask workers), the same ones
        assert got["entrypoint"] == want.entrypoint and ":" not in got["entrypoint"], name
        flow = load_flow_from_entrypoint(got["entrypoint"])
        assert flow.name == want.flow_name, name
        module = importlib.import_module(got["entrypoint"].rsplit(".", 1)[0])
        assert Path(inspect.getsourcefile(flow.fn)) == Path(module.__file__), name
        assert got["parameters"] == want.parameters, name
        assert got["description"] == want.description and got["tags"] == want.tags, name
        assert got["work_pool"] == {"name": PrefectConfig().work_pool}, name

        schedules = got.get("schedules") or []
        assert len(schedules) == len(want.schedules or []), name
        for mine, theirs in zip(schedules, want.schedules or [], strict=True):
            schedule = theirs.schedule
            if "interval" in mine:
                assert timedelta(seconds=mine["interval"]) == schedule.interval, name
            else:
                assert (mine["cron"], getattr(schedule, "day_or", True)) == (schedule.cron, True), name
            assert mine["timezone"] == (schedule.timezone or "UTC"), name

        mine_triggers = [triggers.validate_python(t).model_dump(mode="json") for t in got.get("triggers", [])]
        assert mine_triggers == [t.model_dump(mode="json") for t in want.triggers], name


def test_deploying_without_the_config_dir_is_refused_by_the_build_step(tmp_path: Path) -> None:
    (step,) = _load("prefect.yaml")["build"]
    script = step["prefect.deployments.steps.run_shell_script"]["script"]
    argv = shlex.split(script)  # how run_shell_script runs a line (no shell of its own)
    env = {k: v for k, v in os.environ.items() if k != CONFIG_DIR_VAR}
    for value, ok in ((None, False), ("", False), ("etc/ckptflow", False), ("/etc/ckptflow", True)):
        run_env = env if value is None else {**env, CONFIG_DIR_VAR: value}
        done = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=30)
        assert (done.returncode == 0) == ok, (value, done.stderr)
        if not ok:
            assert CONFIG_DIR_VAR in done.stderr


# ------------------------------------------------------------------------------------ compose.yaml
def _services() -> dict[str, dict[str, Any]]:
    return _load("compose.yaml")["services"]


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _secrets_from_files(service: dict[str, Any]) -> dict[str, str]:
    pairs = _environment(service).get("SECRETS_FROM_FILES", "").split()
    return dict(pair.split("=", 1) for pair in pairs)


def _volume(spec: str) -> tuple[str, str]:
    """(target, source) of a short-syntax volume; ${VAR:-default} in the source may hold colons."""
    masked = re.sub(r"\$\{[^}]*\}", "VAR", spec)
    source, target = masked.split(":")[:2]
    return target, spec[: spec.rfind(":" + target)] if source == "VAR" else source


def _strings(node: Any, path: str = "") -> list[tuple[str, str]]:
    if isinstance(node, dict):
        return [item for key, value in node.items() for item in _strings(value, f"{path}.{key}")]
    if isinstance(node, list):
        return [item for i, value in enumerate(node) for item in _strings(value, f"{path}[{i}]")]
    return [(path, str(node))]


def test_compose_has_the_stack_services() -> None:
    services = _services()
    assert {"postgres", "prefect-server", "s3", "worker", "deploy", "serve", "s3-bucket"} <= set(services)
    assert services["worker"]["profiles"] == ["worker"] and services["serve"]["profiles"] == ["serve"]
    command = services["worker"]["command"]
    assert command[:3] == ["prefect", "worker", "start"]
    assert command[command.index("--pool") + 1] == PrefectConfig().work_pool
    assert command[command.index("--type") + 1] == "process"


def test_compose_publishes_ports_only_on_the_bind_address_loopback_by_default() -> None:
    published = 0
    for name, service in _services().items():
        for port in service.get("ports", []):
            assert isinstance(port, str) and port.startswith(LOOPBACK_DEFAULT), (name, port)
            published += 1
    assert published >= 3
    text = (INFRA / "compose.yaml").read_text()
    # 0.0.0.0 only as a bind address inside a container's own network namespace
    for path, value in _strings(_load("compose.yaml")):
        if "0.0.0.0" in value:
            assert ".command" in path, (path, value)
    assert "host_ip" not in text


def test_compose_holds_no_secret_value() -> None:
    compose = _load("compose.yaml")
    for path, value in _strings(compose):
        for match in URL_USERINFO.finditer(value):
            assert REFERENCE.match(match.group(2)), f"{path}: a URL with a literal password"
    for name, service in compose["services"].items():
        for key, value in _environment(service).items():
            if not SECRET_WORD.search(key) or key == "SECRETS_FROM_FILES":
                continue
            assert REFERENCE.match(value) or value.startswith("/run/secrets/"), (name, key, value)
    for name, secret in compose["secrets"].items():
        assert set(secret) == {"file"}, name  # no inline `environment:` or literal content
        assert secret["file"].startswith("${CKPTFLOW_SECRETS_DIR:?") and secret["file"].endswith(f"/{name}")


def test_compose_wires_every_secret_from_a_mounted_file() -> None:
    compose = _load("compose.yaml")
    declared = set(compose["secrets"])
    used: set[str] = set()
    for name, service in compose["services"].items():
        mounted = set(service.get("secrets", []))
        assert mounted <= declared, name
        used |= mounted
        for variable, file in _secrets_from_files(service).items():
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", variable), (name, variable)
            assert file.startswith("/run/secrets/") and file.rsplit("/", 1)[1] in mounted, (name, file)
        env = _environment(service)
        if "PREFECT_API_URL" in env:  # a Prefect client: it must authenticate
            assert "PREFECT_API_AUTH_STRING" in _secrets_from_files(service), name
    assert used == declared
    assert "PREFECT_SERVER_API_AUTH_STRING" in _secrets_from_files(compose["services"]["prefect-server"])
    db_url = _environment(compose["services"]["prefect-server"])["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert "$${PREFECT_SERVER_DATABASE_PASSWORD}" in db_url  # Prefect fills it in from the secret
    assert "PREFECT_SERVER_DATABASE_PASSWORD" in _secrets_from_files(compose["services"]["prefect-server"])
    # The ckptflow image's entrypoint is what reads SECRETS_FROM_FILES.
    assert 'ENTRYPOINT ["/usr/local/bin/secrets-env"]' in (INFRA / "Dockerfile").read_text()
    for name, service in compose["services"].items():
        if _secrets_from_files(service):
            assert "entrypoint" not in service, name


def test_compose_mounts_what_the_production_config_names() -> None:
    config = load_config(INFRA / "ckptflow.prod.yaml")
    services = _services()
    for name in ("worker", "serve", "deploy", "s3-bucket"):
        service = services[name]
        targets = dict(_volume(v) for v in service["volumes"])
        assert targets["/etc/ckptflow/ckptflow.yaml"] == "./ckptflow.prod.yaml", name
        assert targets["/etc/ckptflow/retention.yaml"] == "./retention.yaml", name
        assert targets["/etc/ckptflow/drill.yaml"] == "./drill.yaml", name
        for tier in ("hot", "warm"):
            assert config.tiers[tier].root in targets, (name, tier)  # type: ignore[union-attr]
        assert _environment(service)[CONFIG_DIR_VAR] == "/etc/ckptflow", name
    for path, value in _strings(_load("compose.yaml")):
        if value.startswith("./"):
            assert (INFRA / value.split(":")[0]).exists(), (path, value)
    # the host names in the config are the services' network aliases
    aliases = {
        a for s in services.values() for a in s.get("networks", {}).get("default", {}).get("aliases", [])
    }
    assert {"ckptflow-db", "ckptflow-prefect", "ckptflow-s3"} <= aliases
    for url in (config.catalog, config.prefect.api_url, config.tiers["cold"].endpoint_url):  # type: ignore[union-attr]
        assert any(f"@{alias}:" in url or f"//{alias}:" in url for alias in aliases), url


def test_env_example_lists_every_compose_variable_and_no_secret() -> None:
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (INFRA / "compose.yaml").read_text()))
    used -= {"PREFECT_SERVER_DATABASE_PASSWORD"}  # $${...}: Prefect's placeholder, not compose's
    listed = {}
    for line in (INFRA / ".env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            listed[key.strip()] = value.strip()
    assert used <= set(listed), used - set(listed)
    assert set(listed) - used <= {"COMPOSE_PROFILES"}, set(listed) - used
    for key in listed:
        assert not SECRET_WORD.search(key) or key == "CKPTFLOW_SECRETS_DIR", key
    assert listed["CKPTFLOW_BIND_ADDRESS"] == "127.0.0.1"


# ------------------------------------------------------------------------------- helper scripts
def test_secrets_env_exports_file_contents_and_never_prints_them(tmp_path: Path) -> None:
    value = "admin:p@ss w0rd$`'\"\\x"
    (tmp_path / "auth").write_text(value + "\n")
    (tmp_path / "empty").write_text("")
    script = str(INFRA / "secrets-env.sh")
    show = ["sh", "-c", 'printf "%s|%s" "$PREFECT_API_AUTH_STRING" "${SECRETS_FROM_FILES-unset}"']

    def run(spec: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": os.environ["PATH"], "SECRETS_FROM_FILES": spec}
        return subprocess.run(["sh", script, *show], env=env, capture_output=True, text=True, timeout=30)

    done = run(f"PREFECT_API_AUTH_STRING={tmp_path / 'auth'}")
    assert done.returncode == 0 and done.stdout == f"{value}|unset", done
    for spec in (
        f"PREFECT_API_AUTH_STRING={tmp_path / 'missing'}",
        f"PREFECT_API_AUTH_STRING={tmp_path / 'empty'}",
        f"BAD-NAME={tmp_path / 'auth'}",
        "NO_PATH_GIVEN",
    ):
        done = run(spec)
        assert done.returncode == 2 and done.stdout == "" and value not in done.stderr, (spec, done)
    assert os.access(INFRA / "secrets-env.sh", os.R_OK)


def test_seaweed_entrypoint_turns_s3_auth_on_without_keys_on_the_command_line(tmp_path: Path) -> None:
    secrets_dir, bin_dir, out = tmp_path / "secrets", tmp_path / "bin", tmp_path / "out"
    secrets_dir.mkdir()
    bin_dir.mkdir()
    (secrets_dir / "s3_access_key_id").write_text("CKPTKEYID0123\n")
    (secrets_dir / "s3_secret_access_key").write_text("s3cr3t/Value+with=chars_\n")
    fake_weed = bin_dir / "weed"  # records its arguments and the identities file it was given
    fake_weed.write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" > "$OUT.args"\n'
        'for a in "$@"; do case $a in -s3.config=*) cp "${a#-s3.config=}" "$OUT.json";; esac; done\n'
    )
    fake_weed.chmod(fake_weed.stat().st_mode | stat.S_IXUSR)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT": str(out),
        "CKPTFLOW_SECRETS_MOUNT": str(secrets_dir),
        "SEAWEED_DATA_DIR": str(tmp_path / "data"),
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run(
        ["sh", str(INFRA / "seaweed-entrypoint.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    args = Path(f"{out}.args").read_text().split()
    identities = json.loads(Path(f"{out}.json").read_text())
    (identity,) = identities["identities"]
    assert identity["credentials"] == [
        {"accessKey": "CKPTKEYID0123", "secretKey": "s3cr3t/Value+with=chars_"}
    ]
    assert "CKPTKEYID0123" not in " ".join(args) and "s3cr3t" not in " ".join(args)
    assert args[0] == "server" and "-s3" in args and "-master.telemetry=false" in args
    assert "-ip.bind=127.0.0.1" in args and "-s3.ip.bind=0.0.0.0" in args
    assert "-s3.port.iceberg=0" in args and "-s3.port.lance=0" in args
    (secrets_dir / "s3_secret_access_key").write_text('bad"quote\n')
    done = subprocess.run(
        ["sh", str(INFRA / "seaweed-entrypoint.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and "bad" not in done.stderr


def test_the_image_build_context_excludes_secrets() -> None:
    ignored = (INFRA / "Dockerfile.dockerignore").read_text().splitlines()
    for pattern in ("**/.env", "**/secrets", "**/*.pem", "**/*.key", ".venv", ".scratch"):
        assert pattern in ignored, pattern
