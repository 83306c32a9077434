"""The manager: registry, control, record feed, rebuild, metrics, the service"""
