"""Encrypting secrets a team gives us (its S3 credentials) before they reach the database.

The key comes from E31_CREDENTIALS_KEY, or is derived from SECRET_KEY. Encrypted values are
never shown back and never passed to a job's process; only the runner's staging reads them.
"""

import base64
import hashlib
import json

from django.conf import settings

# cryptography (10 ms) is imported when a secret is sealed or opened, not with the models that
# keep sealed values: every process loads those, and few of them open a secret.


class CannotDecrypt(Exception):
    pass


def _fernet():
    from cryptography.fernet import Fernet

    material = settings.E31_CREDENTIALS_KEY or settings.SECRET_KEY
    key = base64.urlsafe_b64encode(hashlib.sha256(b"e31-credentials:" + material.encode()).digest())
    return Fernet(key)


def seal(values):
    """A dict of strings, encrypted to one opaque token."""
    return _fernet().encrypt(json.dumps(values).encode()).decode()


def unseal(token):
    from cryptography.fernet import InvalidToken

    try:
        return json.loads(_fernet().decrypt(token.encode()))
    except (InvalidToken, ValueError) as error:
        raise CannotDecrypt("the stored credentials cannot be read with this key") from error
