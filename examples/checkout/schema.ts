// The checkout's own table: its columns, its names, in its own schema (public). outboxd's tables live
// beside it in the schema `outboxd`, so the two `orders` never meet.
import { sql } from 'drizzle-orm';
import { integer, pgTable, text, timestamp, uuid } from 'drizzle-orm/pg-core';

export const ORDER_STATUSES = ['awaiting_payment', 'paid', 'payment_failed'] as const;

export const orders = pgTable('orders', {
  id: uuid('id').primaryKey().defaultRandom(),
  email: text('email').notNull(),
  totalCents: integer('total_cents').notNull(),
  currency: text('currency').notNull(),
  /** Stripe customer (cus_…) paying for it. */
  customer: text('customer').notNull(),
  status: text('status', { enum: ORDER_STATUSES }).notNull().default('awaiting_payment'),
  /** The charge operation currently paying for it (a new one after a declined card). */
  paymentOperationId: uuid('payment_operation_id'),
  createdAt: timestamp('created_at', { withTimezone: true }).notNull().default(sql`now()`),
});

/** The example keeps its DDL here instead of migrations of its own: one table, created if missing. */
export const CREATE_ORDERS = sql`
  create table if not exists orders (
    id uuid primary key default gen_random_uuid(),
    email text not null,
    total_cents integer not null,
    currency text not null,
    customer text not null,
    status text not null default 'awaiting_payment' check (status in ('awaiting_payment', 'paid', 'payment_failed')),
    payment_operation_id uuid,
    created_at timestamptz not null default now()
  )`;
