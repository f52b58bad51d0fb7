"""The daemon's face: the asyncio service, HTTP and the query API, metrics, systemd notify, config.
"""
