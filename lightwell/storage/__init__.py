"""Models in object storage (S3 and S3-compatible stores): listing, parallel ranged GETs, a
download cache, ``lightwell download``. Pure Python (boto3): the engine, the CLI and the model
loader all use it."""
