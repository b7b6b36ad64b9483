#!/usr/bin/env python
import gc
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "e31web.settings")
    # Starting (Django's setup, the models, the command's own imports) makes some hundred thousand
    # objects that all live on: the cyclic collector would walk them again and again for nothing,
    # a seventh of the start of a node agent inside a Slurm job, where it is on the meter. It is
    # off until the command is loaded, then on, with what the start made kept out of its way.
    gc.disable()
    from django.core.management import ManagementUtility

    class Utility(ManagementUtility):
        def fetch_command(self, subcommand):
            command = super().fetch_command(subcommand)
            gc.freeze()
            gc.enable()
            return command

    Utility(sys.argv).execute()
