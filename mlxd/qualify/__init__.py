"""``mlxd model qualify``: prove a registered model works through the real server.

Above ``server/`` (it builds and starts one) and ``workflow/`` (it reads the
registry and writes manifests); only ``cli/`` imports it.
"""
