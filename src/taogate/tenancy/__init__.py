"""Teams on one gateway: named keys beside the unified one, their limits, and their fair share.

``keys`` identifies a client by its key; ``window`` is the pure sliding-window arithmetic; ``store``
keeps the counters (in-process, or Redis for several replicas); ``limiter`` admits a request against
its key's limits and answers as OpenAI does; ``fairshare`` orders the gateway queue by each key's
recent tokens; ``keyfile`` edits ``[[keys]]`` in a config file for ``taogate keys``.
"""
