"""The per-node agent: the share of the pipeline that must run where a node's disk is.

``ckptflow agent --config ckptflow.yaml`` runs on every training node for the life of the job
(``srun --ntasks-per-node=1``, a Kubernetes sidecar or DaemonSet: docs/DEPLOY.md). It serves this
node's Prefect deployments, so their flow runs execute here, as subprocesses of the agent, and show
in the Prefect UI under the node's name:

- ``promote-part/node-<host>``: copy this node's part to warm, publish when complete;
- ``replicate-part/node-<host>``: copy this node's part to its ``replication.factor - 1`` peers'
  NVMe (``ckptflow.peer``), in parallel with the promotion;
- ``node-housekeeping/node-<host>``: on an interval, sync this node's holdings into the catalog,
  clean stale partials, promote what events missed.

With a replication secret configured (``replication.secret_file`` or ``secret_env``), the agent also
serves this node's hot root to its peers (:class:`ckptflow.peer.PeerServer`, on
``replication.bind_host:port`` or ``--peer-bind``) and registers the address in the catalog, where
pushers and restores look it up by host name.

Both part flows start the moment the node's part is committed on its disk (``--on-commit watch``,
the default): the agent watches its hot root (:mod:`ckptflow.agent.commit_watch`) and runs them
itself, as flow runs in its own process (:mod:`ckptflow.agent.part_runs`), with no round trip
through the Prefect server first. With ``--on-commit event`` they are triggered instead by every
``ckptflow.checkpoint.staged`` event that names this host as one of its nodes (the event carries one
related resource per node; the trigger's ``match_related`` picks this host's), seconds after the
commit.

Routing choice (see ../shared/MULTINODE.md §5): one deployment per node, served by that node's agent
(``serve``), matching the node in the event's related resources. No work-pool queue naming, no
dispatcher flow, one automation per deployment that Prefect creates from the trigger; an agent that
is down simply leaves its node's part for its housekeeping (or the pipeline's reconcile) to catch up.
"""
