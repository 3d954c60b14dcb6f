"""Scale-out on Ray Serve (the optional `ray` extra).

Only `surge.distributed.config` is importable without Ray (model.yaml embeds its
`RayDeploymentConfig` as a `ray:` section); everything else here imports Ray,
and nothing outside this package imports it (the CLI does, lazily, under --ray).
"""
