"""How arrays are spread over devices: the device mesh, and logical/path rules -> NamedShardings."""
