"""rollout_tasks.purpose: stage-3 entry probes beside training tasks

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 14:10:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('rollout_tasks', sa.Column('purpose', sa.String(length=16), nullable=False, server_default='train'))


def downgrade() -> None:
    op.drop_column('rollout_tasks', 'purpose')
