"""Encrypting secrets a team gives us (its S3 credentials) before they reach the database.

The key comes from E31_CREDENTIALS_KEY, or is derived from SECRET_KEY. Encrypted values are
never shown back and never passed to a job's process; only the runner's staging reads them.
"""

import base64
import hashlib
import json

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings


class CannotDecrypt(Exception):
    pass


def _fernet():
    material = settings.E31_CREDENTIALS_KEY or settings.SECRET_KEY
    key = base64.urlsafe_b64encode(hashlib.sha256(b"e31-credentials:" + material.encode()).digest())
    return Fernet(key)


def seal(values):
    """A dict of strings, encrypted to one opaque token."""
    return _fernet().encrypt(json.dumps(values).encode()).decode()


def unseal(token):
    try:
        return json.loads(_fernet().decrypt(token.encode()))
    except (InvalidToken, ValueError) as error:
        raise CannotDecrypt("the stored credentials cannot be read with this key") from error
