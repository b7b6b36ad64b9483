"""A client for a team's registered S3 bucket: the dataset scan (catalog.datasets) and staging
(agent.staging) read through it."""

from functools import lru_cache

from core.endpoints import check_endpoint, pin_boto3
from core.secrets_box import unseal


class BucketRefused(Exception):
    """The bucket's endpoint is refused (core.endpoints): a private address, say."""


@lru_cache(maxsize=64)
def team_bucket(dataset_id, credentials_token, endpoint_url, region):
    """A client for a team's registered bucket, with its (decrypted) credentials. These stay in
    the runner: a job's environment is built from scratch without them."""
    # boto3 is imported when a bucket is first used, not with every process that imports this
    # module (the web server's): it takes a noticeable part of a second.
    import boto3
    from botocore.config import Config

    # The endpoint's host is judged again here (its DNS may have changed since registration);
    # a refusal is not cached, so the check runs until it passes. The client is kept, so each
    # connection it opens is judged too, and made to the address judged (pin_boto3).
    if reason := check_endpoint(endpoint_url):
        raise BucketRefused(f"the bucket's endpoint is refused: {reason}")

    credentials = unseal(credentials_token) if credentials_token else {}
    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url or None,
        aws_access_key_id=credentials.get("access_key_id"),
        aws_secret_access_key=credentials.get("secret_access_key"),
        region_name=region or "us-east-1",
        config=Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"max_attempts": 5, "mode": "standard"},
            max_pool_connections=32,  # a runner's stagings at once, each with its workers
            proxies={},
        ),  # never an environment's proxy, which would connect by name
    )
    return pin_boto3(client, "s3")
