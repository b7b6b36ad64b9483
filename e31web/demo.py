"""The embedded default's demo: a team, a user, an operator, the digits dataset and a rate."""

import io
import os
from decimal import Decimal

import numpy as np
from django.contrib.auth import get_user_model
from django.db import transaction

from accounts.models import Membership, Team
from billing.models import Rate
from catalog.datasets import create_dataset
from catalog.models import Dataset

DEMO_USER = ("demo", "demo-e31")
OPERATOR = ("operator", "operator-e31")
DEMO_TEAM = "Demo team"
PREEMPTIBLE_SHARE = Decimal("0.6")  # of the rate, by default: preemptible jobs pay 40% less
RATE_PLACES = Decimal("0.0001")  # as Rate stores it


def digits_split(seed=0, heldout_fraction=0.2):
    """scikit-learn's digits shuffled once and split (as examples/digits/train.py does)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    cut = int(len(order) * (1 - heldout_fraction))
    return (digits.data[order[:cut]], digits.target[order[:cut]]), (digits.data[order[cut:]], digits.target[order[cut:]])


def digits_csv(x, y):
    out = io.StringIO()
    out.write(",".join([f"p{i}" for i in range(64)] + ["label"]) + "\n")
    for row, label in zip(x.astype(int), y):
        out.write(",".join(map(str, row)) + f",{label}\n")
    return out.getvalue().encode()


def add_dataset(team, name, files, description=""):
    """A dataset from {path: bytes}; kept as is if the team already has one by that name."""
    existing = Dataset.objects.filter(team=team, name=name).first()
    return existing or create_dataset(team, name, files, description)


@transaction.atomic
def seed():
    users = get_user_model().objects
    team, _ = Team.objects.get_or_create(name=DEMO_TEAM)
    user, _ = users.get_or_create(username=DEMO_USER[0])
    user.set_password(DEMO_USER[1])
    user.save()
    Membership.objects.update_or_create(user=user, defaults={"team": team, "role": Membership.OWNER})
    operator, _ = users.get_or_create(username=OPERATOR[0], defaults={"is_staff": True, "is_superuser": True})
    operator.set_password(OPERATOR[1])
    operator.save()

    (x_train, y_train), (x_held, y_held) = digits_split()
    add_dataset(team, "digits", {"digits-train.csv": digits_csv(x_train, y_train)}, "scikit-learn handwritten digits, training split")
    add_dataset(team, "digits-heldout", {"digits-heldout.csv": digits_csv(x_held, y_held)}, "the held-out split")

    rate = None
    if not Rate.objects.exists():
        # The operator's first rate, so the demo can run; change it in the admin. It has a
        # preemptible price, as examples/specs/finetune.yaml promises a cheaper rate.
        per_gpu_hour = Decimal(os.environ.get("E31_DEMO_RATE", "2.50"))
        preemptible = os.environ.get("E31_DEMO_PREEMPTIBLE_RATE") or per_gpu_hour * PREEMPTIBLE_SHARE
        rate = Rate.objects.create(
            gpu_type="",
            per_gpu_hour=per_gpu_hour,
            preemptible_per_gpu_hour=Decimal(preemptible).quantize(RATE_PLACES),
        )
    return {"team": team, "user": user, "operator": operator, "rate": rate}
