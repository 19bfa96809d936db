// Placeholder: the device API lands in the next commit (docs/device-api.md).
