"""The deployment YAML, typed at the edge.

``load_config(path)`` returns a ``DeploymentConfig`` or raises ``ConfigError`` whose message names
each bad field by its path (``replicas.max_queue: must be >= 0``), never a traceback. Unknown keys
are errors (``extra="forbid"``): a typo must not silently fall back to a default.

``ReplicaSettings`` is what one replica process runs with; the launcher derives one per device
from the deployment (``DeploymentConfig.replica_settings``), and ``gpupool replica`` builds one
from its flags.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

Dtype = Literal["auto", "bfloat16", "float16", "float32"]


class ConfigError(ValueError):
    """A deployment file or a set of flags that cannot run; the message is for a person."""


_NUMBERS: tuple[object, ...] = (int, float, int | None)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML reads yes/no/on/off/true as booleans: never take one for a number."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and field.annotation in _NUMBERS:
            raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


class ModelConfig(_Strict):
    # builtin:smollm2-135m | builtin:tiny-random | /path/to/hf-folder | /path/model.gguf
    # | simulated[:key=value,...]
    source: str = Field("builtin:smollm2-135m", min_length=1)
    # auto: bfloat16 on CUDA, float32 on CPU.
    dtype: Dtype = "auto"
    max_input_tokens: int = Field(2048, ge=1)
    # Checked before tokenizing, so a huge text costs nothing. Default: 16 characters per token.
    max_input_chars: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(512, ge=1)
    # Request bodies above this are answered 413 before they are parsed.
    max_body_bytes: int = Field(1_000_000, ge=1024)

    @property
    def input_char_limit(self) -> int:
        return self.max_input_chars or self.max_input_tokens * 16


DeviceEntry = int | Literal["cpu"]


def _parse_devices(value: Any) -> Any:
    """One clear message for a bad ``devices`` value instead of one per union branch."""
    if value == "all":
        return value
    if not isinstance(value, list):
        raise ValueError(f'must be "all" or a list of GPU indices and "cpu" entries, got {value!r}')
    for i, entry in enumerate(value):
        ok = entry == "cpu" or (
            isinstance(entry, int) and not isinstance(entry, bool) and entry >= 0
        )
        if not ok:
            raise ValueError(f'entry {i} must be a GPU index (0, 1, ...) or "cpu", got {entry!r}')
    gpus = [d for d in value if d != "cpu"]
    if len(gpus) != len(set(gpus)):
        raise ValueError(f"GPU indices repeat: {value}")
    return value


def _one_cpu() -> list[DeviceEntry]:
    return ["cpu"]


class ReplicasConfig(_Strict):
    # A list of GPU indices (NVML numbering) and/or "cpu" entries, or "all" for every GPU.
    # Empty ([]) only on a router-only host: then remote_replicas or router.discovery is required.
    devices: Annotated[list[DeviceEntry] | Literal["all"], BeforeValidator(_parse_devices)] = Field(
        default_factory=_one_cpu
    )
    host: str = Field("127.0.0.1", min_length=1)
    port_base: int = Field(9100, ge=1, le=65535)
    max_concurrency: int = Field(1, ge=1)
    max_queue: int = Field(32, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    request_timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False)
    # How long `gpupool up` waits for a replica to load and warm up.
    ready_timeout_s: float = Field(600.0, gt=0)
    # Free device memory a GPU must keep beyond the model's weights estimate at start-up.
    headroom_mb: int = Field(1024, ge=0)
    # A replica that crashes this many times in a row is reported and left down.
    max_restarts: int = Field(5, ge=0)


def check_url(url: str) -> str:
    """A replica's base URL without its trailing slash; ValueError saying what is wrong."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: the URL must start with http:// or https://")
    if not parts.hostname or any(c.isspace() for c in url):
        raise ValueError(f"{url!r}: no valid host in the URL")
    if port == 0:
        raise ValueError(f"{url!r}: port 0 is not a port to connect to")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a replica's base URL has no query or fragment")
    return url.rstrip("/")


class RemoteReplica(_Strict):
    url: str
    name: str | None = None

    @model_validator(mode="after")
    def _url_is_a_base_url(self) -> RemoteReplica:
        self.url = check_url(self.url)
        return self


class DnsDiscovery(_Strict):
    """Resolve a (headless Service) name periodically; every address becomes a replica."""

    name: str = Field(min_length=1)
    port: int = Field(9100, ge=1, le=65535)
    interval_s: float = Field(5.0, gt=0)


class RouterConfig(_Strict):
    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(8000, ge=1, le=65535)
    health_interval_s: float = Field(1.0, gt=0)
    health_timeout_s: float = Field(1.0, gt=0)
    fail_threshold: int = Field(2, ge=1)
    success_threshold: int = Field(1, ge=1)
    # A replica whose NVML free memory is below this takes no new work (ignored on CPU replicas).
    min_free_memory_mb: int = Field(1024, ge=0)
    # Names of environment variables holding comma-separated keys; unset or empty: no auth.
    api_keys_env: str = "GPUPOOL_API_KEYS"
    admin_keys_env: str = "GPUPOOL_ADMIN_KEYS"
    # Attempts per request across replicas (1 = never retry), and the share of recent requests
    # that may be retries, so a fleet-wide outage does not multiply load.
    max_attempts: int = Field(3, ge=1)
    retry_budget_ratio: float = Field(0.2, ge=0)
    # How long the router waits for the next bytes from a replica (a silent replica: 504); a
    # stream that keeps sending may run longer. The replica's request_timeout_s bounds the total.
    request_timeout_s: float = Field(300.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    # On shutdown, how long in-flight requests may take to finish.
    drain_timeout_s: float = Field(30.0, ge=0)
    discovery: DnsDiscovery | None = None


class ReplicaSettings(_Strict):
    """Everything one replica process needs. Built from flags or from one deployment entry."""

    name: str = "replica"
    model: ModelConfig = Field(default_factory=ModelConfig)
    # cpu | cuda | cuda:N. A GPU replica started by `gpupool up` sees one GPU, as cuda.
    device: str = "cpu"
    # The value `gpupool up` puts in the child's environment (None for CPU replicas).
    cuda_visible_devices: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(9100, ge=0, le=65535)
    max_concurrency: int = Field(1, ge=1)
    max_queue: int = Field(32, ge=0)
    queue_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    request_timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _device_shape(self) -> ReplicaSettings:
        d = self.device
        if not (d in ("cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {d!r}")
        return self

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"


class DeploymentConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    remote_replicas: list[RemoteReplica] = Field(default_factory=list)
    router: RouterConfig = Field(default_factory=RouterConfig)

    @model_validator(mode="after")
    def _ports_do_not_collide(self) -> DeploymentConfig:
        if self.replicas.devices == [] and not (self.remote_replicas or self.router.discovery):
            raise ValueError(
                'replicas.devices: give at least one entry, or "all" (an empty list is for a '
                "router-only host, with remote_replicas or router.discovery)"
            )
        if isinstance(self.replicas.devices, list):
            count = len(self.replicas.devices)
            last = self.replicas.port_base + count - 1
            if last > 65535:
                raise ValueError(
                    f"replicas.port_base: {count} replicas from {self.replicas.port_base} "
                    f"run past port 65535"
                )
            if self.replicas.port_base <= self.router.port <= last:
                raise ValueError(
                    f"router.port: {self.router.port} collides with the replica ports "
                    f"{self.replicas.port_base}-{last}"
                )
        names = [r.name for r in self.remote_replicas if r.name]
        if len(names) != len(set(names)):
            raise ValueError(f"remote_replicas: names repeat: {names}")
        return self

    def replica_settings(self, gpu_indices: list[int] | None = None) -> list[ReplicaSettings]:
        """One ReplicaSettings per local device; ``gpu_indices`` resolves ``devices: all``."""
        devices: list[DeviceEntry]
        if self.replicas.devices == "all":
            if not gpu_indices:
                raise ConfigError('replicas.devices: "all" but no GPU was found (NVML sees none)')
            devices = list(gpu_indices)
        else:
            devices = list(self.replicas.devices)
        settings = []
        cpu_count = 0
        for position, device in enumerate(devices):
            if device == "cpu":
                name, dev, visible = f"cpu{cpu_count}", "cpu", None
                cpu_count += 1
            else:
                name, dev, visible = f"gpu{device}", "cuda", str(device)
            settings.append(
                ReplicaSettings(
                    name=name,
                    model=self.model,
                    device=dev,
                    cuda_visible_devices=visible,
                    host=self.replicas.host,
                    port=self.replicas.port_base + position,
                    max_concurrency=self.replicas.max_concurrency,
                    max_queue=self.replicas.max_queue,
                    queue_timeout_s=self.replicas.queue_timeout_s,
                    request_timeout_s=self.replicas.request_timeout_s,
                )
            )
        return settings

    def remote_endpoints(self) -> list[tuple[str, str]]:
        """(name, base URL) of every remote replica; unnamed ones are called remote0, remote1..."""
        return [
            (r.name or f"remote{i}", r.url.rstrip("/")) for i, r in enumerate(self.remote_replicas)
        ]


_MESSAGES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "extra_forbidden": "unknown key (check the spelling; see configs/local.yaml)",
    "missing": "is required",
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "model_type": "must be a mapping (indented key: value lines)",
    "dict_type": "must be a mapping (indented key: value lines)",
    "literal_error": "must be one of {expected}",
    "int_from_float": "must be a whole number",
    "string_too_short": "must not be empty",
}


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``X``, ``X | None``, ``list[X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)


def _did_you_mean(root: type[BaseModel] | None, loc: tuple[int | str, ...]) -> str:
    """`` (did you mean port?)`` for a misspelt key at ``loc``, or nothing."""
    model = root
    for part in loc[:-1]:
        if model is None:
            return ""
        if isinstance(part, str):
            field = model.model_fields.get(part)
            model = _model_in(field.annotation) if field is not None else None
    if model is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def format_validation_error(
    exc: ValidationError, prefix: str = "", root: type[BaseModel] | None = None
) -> str:
    """One line per problem: ``field.path: problem``; ``root`` (the validated model) lets a
    misspelt key suggest the right one."""
    lines = []
    for err in exc.errors():
        # Drop the union-branch names pydantic adds ("int", "literal['cpu']"...).
        parts = [
            str(p)
            for p in err["loc"]
            if not (isinstance(p, str) and (p.startswith(("literal[", "list[")) or p == "int"))
        ]
        path = ".".join(parts)
        template = _MESSAGES.get(err["type"])
        message = template.format(**err.get("ctx", {})) if template else err["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        if err["type"] == "extra_forbidden" and (hint := _did_you_mean(root, tuple(err["loc"]))):
            message = "unknown key" + hint
        got = err.get("input")
        if err["type"] in _MESSAGES and err["type"] not in ("missing", "extra_forbidden"):
            message += f" (got {got!r})"
        lines.append(f"{prefix}{path}: {message}" if path else f"{prefix}{message}")
    return "\n".join(dict.fromkeys(lines))


def parse_config(data: Any, origin: str = "config") -> DeploymentConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping (model:, replicas:, ...)")
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as exc:
        problems = format_validation_error(exc, root=DeploymentConfig)
        raise ConfigError(f"{origin}: invalid configuration\n{problems}") from exc


def load_config(path: str | Path) -> DeploymentConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such file") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (is it a YAML file?)") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(data, origin=str(path))
