"""``python -m na3d.distributed``: the traffic table of docs/distributed.md (LTX stage 5)."""

from .traffic import traffic_table

print(traffic_table())
