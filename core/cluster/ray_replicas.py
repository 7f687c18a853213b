"""Inference replicas as Ray actors across nodes, behind one :class:`~tracerl.cluster.Router`.

``RayReplicas(model_path, replicas=N)`` is an :class:`~tracerl.inference.InferenceServer`: ``start``
places N actors (``SPREAD`` over the cluster's nodes), each starting a tracerl inference server
(transformers or vLLM) on its node's IP, and a router in this process in front of them;
``base_url`` is the router's.  ``load_adapter(name, path)`` reads the adapter folder here, puts
its bytes in Ray's object store once and has every actor write its own copy and hot-load it:
nodes need no shared filesystem.  Actors are ended with ``ray.kill`` by handle (never by name).

Needs ``tracerl[ray]`` and a running Ray (``ray.init()``, or ``ray.init(address=...)``).
The base model folder must exist at ``model_path`` on every node (as the checkpoint folder of a
hub model in each node's cache would).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InferenceServerError
from .router import Router


class _ReplicaActor:
    """One inference server on one node (made a Ray actor class by :func:`_actor_class`)."""

    def __init__(self, kind: str, model_path: str, served_name: str, options: dict[str, Any]) -> None:
        import ray

        from ..inference.base import make_server

        self.host = ray.util.get_node_ip_address()
        self.server = make_server(kind, model_path, served_name=served_name, host=self.host, **options)  # type: ignore[arg-type]
        self.adapters = Path(tempfile.mkdtemp(prefix="tracerl-ray-adapters-"))

    async def start(self) -> str:
        await self.server.start()
        return self.server.base_url.removesuffix("/v1")

    def node_id(self) -> str:
        """The Ray node this replica runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    async def load_adapter(self, name: str, files: dict[str, bytes]) -> str:
        """Write the shipped adapter files to this node and hot-load them; return the local folder."""
        folder = self.adapters / name.replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        for relative, data in files.items():
            target = folder / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        await self.server.load_adapter(name, str(folder))
        return str(folder)

    async def stop(self) -> None:
        await self.server.stop()


def _actor_class(num_cpus: float, num_gpus: float) -> Any:
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(_ReplicaActor)


def adapter_files(path: str | Path) -> dict[str, bytes]:
    """Every file of a peft adapter folder, by relative path (the optimizer state is left out: serving needs none)."""
    root = Path(path)
    if not (root / "adapter_config.json").exists():
        raise ConfigError(f"no peft adapter at {root} (adapter_config.json is missing)")
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*"))
            if f.is_file() and f.name != "optimizer.pt"}


class RayReplicas:
    """N inference replicas as Ray actors plus a local router: one OpenAI URL for the rollouts."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        replicas: int = 2,
        kind: str = "transformers",
        served_name: str = "base",
        num_cpus: float = 1,
        num_gpus: float = 0,
        server_options: dict[str, Any] | None = None,
        router_options: dict[str, Any] | None = None,
    ) -> None:
        if replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {replicas}")
        self.model_path = str(model_path)
        self.replicas = replicas
        self.kind = kind
        self.served_name = served_name
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.server_options = dict(server_options or {})
        self.router_options = dict(router_options or {})
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.router: Router | None = None
        self.base_url = ""
        from ..net.http_server import new_api_key

        self.api_key: str = self.server_options.pop("api_key", None) or new_api_key()
        """The bearer key every replica checks (the router forwards the client's): ``model.inference_api_key``."""

    async def start(self) -> None:
        import ray

        if not ray.is_initialized():
            raise InferenceServerError("Ray is not running here: call ray.init() (or ray.init(address=...)) first")
        actor = _actor_class(self.num_cpus, self.num_gpus)
        options = {**self.server_options, "api_key": self.api_key}
        self.actors = [actor.options(scheduling_strategy="SPREAD").remote(self.kind, self.model_path, self.served_name,
                                                                          options)
                       for _ in range(self.replicas)]
        try:
            self.urls = list(await asyncio.gather(*(a.start.remote() for a in self.actors)))
        except Exception as error:  # noqa: BLE001 - translated at the boundary
            await self.stop()
            raise InferenceServerError(f"a Ray inference replica failed to start: {type(error).__name__}: {error}") from error
        self.router = Router(self.urls, api_key=self.api_key, **self.router_options)
        await self.router.start()
        self.base_url = self.router.base_url

    async def load_adapter(self, name: str, path: str) -> None:
        """Ship the adapter folder through the object store to every replica and hot-load it there."""
        import ray

        await self.load_adapter_files(name, ray.put(adapter_files(path)))  # once; each node pulls it from the object store

    async def load_adapter_files(self, name: str, files: Any) -> None:
        """Hot-load an adapter already in the object store (``ray.put(adapter_files(folder))``, e.g. by
        the trainer actor on its node) on every replica."""
        try:
            await asyncio.gather(*(a.load_adapter.remote(name, files) for a in self.actors))
        except Exception as error:  # noqa: BLE001
            raise InferenceServerError(f"hot-loading {name!r} on the Ray replicas failed: {error}") from error

    async def health(self) -> bool:
        return self.router is not None and await self.router.health()

    async def stop(self) -> None:
        import ray

        if self.router is not None:
            await self.router.stop()
            self.router = None
        for actor in self.actors:
            try:
                await actor.stop.remote()
            except Exception:  # noqa: BLE001 - an actor that died is ended below all the same
                pass
            ray.kill(actor)
        self.actors = []
