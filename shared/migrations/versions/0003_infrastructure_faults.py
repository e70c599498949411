"""trajectory_groups.attempt and n_tool_failure: groups hit by infrastructure faults

A group that lost too many rollouts to ``tool_failure`` is recorded with status
``redispatch`` and the attempt it came from, so the orchestrator rolls its task out again.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 14:20:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('trajectory_groups', sa.Column('attempt', sa.Integer(), nullable=False, server_default='1'))
    op.add_column('trajectory_groups', sa.Column('n_tool_failure', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    op.drop_column('trajectory_groups', 'n_tool_failure')
    op.drop_column('trajectory_groups', 'attempt')
