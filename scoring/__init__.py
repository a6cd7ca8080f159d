"""Bulk scoring (``redbatch score``) and file submission (``redbatch submit``): programs
built on the client, with their inputs, outputs, pacing against bounded queues and progress.

A user of producer/ like any other: a service that only submits jobs never imports this.
"""
