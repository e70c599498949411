"""trajectory_groups.learner_skipped: groups the learner will never train

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 03:50:00
"""
from alembic import op
import sqlalchemy as sa

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('trajectory_groups', sa.Column('learner_skipped', sa.String(length=32), nullable=True))


def downgrade() -> None:
    op.drop_column('trajectory_groups', 'learner_skipped')
