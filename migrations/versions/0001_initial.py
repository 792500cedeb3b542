"""Initial schema: traces, drafter_versions, dead_letters, consumer_offsets, stream_events.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade():
    op.create_table(
        "traces",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("request_id", sa.String(256), nullable=False),
        sa.Column("trace_id", sa.String(128), nullable=False),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("tag", sa.String(256), nullable=True),
        sa.Column("target_model", sa.String(256), nullable=False),
        sa.Column("drafter_version", sa.String(256), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("top_p", sa.Float(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("max_new_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("drafted", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_traces"),
        sa.UniqueConstraint("event_id", name="uq_traces_event_id"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_traces_request_id", "traces", ["request_id"])
    op.create_index("ix_traces_drafter_version", "traces", ["drafter_version"])
    op.create_index("ix_traces_created_at", "traces", ["created_at"])
    op.create_index("ix_traces_tag_id", "traces", ["tag", "id"])

    op.create_table(
        "drafter_versions",
        sa.Column("target_model", sa.String(256), nullable=False),
        sa.Column("version", sa.String(256), nullable=False),
        sa.Column("first_seen_at", sa.Float(), nullable=False),
        sa.Column("last_seen_at", sa.Float(), nullable=False),
        sa.Column("traces", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("target_model", "version", name="pk_drafter_versions"),
    )

    op.create_table(
        "dead_letters",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("source", sa.String(256), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=True),
        sa.Column("offset", sa.BigInteger(), nullable=True),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_dead_letters"),
        sa.UniqueConstraint("source", "partition", "offset", name="uq_dead_letters_position"),
    )

    op.create_table(
        "consumer_offsets",
        sa.Column("consumer_group", sa.String(256), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("consumer_group", "partition", name="pk_consumer_offsets"),
    )

    op.create_table(
        "stream_events",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("key", sa.Text(), nullable=True),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_stream_events"),
        sqlite_autoincrement=True,
    )


def downgrade():
    for table in ("stream_events", "consumer_offsets", "dead_letters", "drafter_versions", "traces"):
        op.drop_table(table)
