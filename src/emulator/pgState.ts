// The emulator's state in PostgreSQL, in its own schema `stripe_emulator` (created here, idempotently:
// it is Stripe's side, not outboxd's, so it has no drizzle migration). Every process that serves the
// emulator from the same database sees one ledger, one set of idempotency keys (a key executing in one
// process is a 409 in another), one clock, one set of faults, and all of it survives restarts.
import pg from 'pg';
import { inTransaction, openPool, type Tx } from './pg.ts';
import {
  endpointOf,
  pickFaults,
  setIntentStatus,
  type ActiveRule,
  type EmulatedEvent,
  type EmulatorState,
  type Endpoint,
  type Fault,
  type FaultRule,
  type IntentChange,
  type KeyClaim,
  type LedgerEntry,
  type PaymentIntent,
  type Refund,
  type RefundEntry,
  type RefundStatus,
  type SearchSettings,
  type StoredResponse,
  type WebhookTarget,
} from './state.ts';

const SCHEMA_LOCK = 7_411_003;

const DDL = `
create schema if not exists stripe_emulator;
create table if not exists stripe_emulator.settings (
  singleton boolean primary key default true check (singleton),
  clock_offset_ms bigint not null default 0,
  search_lag_ms bigint not null default 0,
  search_frozen_at_ms bigint,
  webhooks jsonb
);
alter table stripe_emulator.settings add column if not exists rate_limit double precision; -- requests/s, null: none
alter table stripe_emulator.settings add column if not exists rate_tokens double precision not null default 0;
alter table stripe_emulator.settings add column if not exists rate_refilled_at timestamptz not null default now();
alter table stripe_emulator.settings add column if not exists account_rate_limit double precision; -- each connected account's, null: rate_limit
alter table stripe_emulator.settings add column if not exists revoked_accounts text[] not null default '{}'; -- refuse the platform
create table if not exists stripe_emulator.account_rates (
  account text primary key,
  tokens double precision not null,
  refilled_at timestamptz not null default now()
);
insert into stripe_emulator.settings default values on conflict do nothing;
create table if not exists stripe_emulator.faults (
  seq bigserial primary key,
  endpoint text not null,
  match jsonb not null,
  fault jsonb not null,
  remaining integer -- null: every matching request
);
create table if not exists stripe_emulator.idempotency_keys (
  store_key text primary key,
  state text not null check (state in ('executing', 'done')),
  params_hash text not null,
  created_ms bigint not null,
  claimer integer, -- backend pid of the claiming process's session, while executing
  response_status integer,
  response_body text -- the exact bytes, replayed as they were first sent
);
create table if not exists stripe_emulator.payment_intents (
  seq bigserial unique,
  id text primary key,
  created_ms bigint not null,
  idempotency_key text,
  body text not null -- JSON as Stripe sends it (jsonb would reorder its keys)
);
create table if not exists stripe_emulator.refunds (
  seq bigserial unique,
  id text primary key,
  payment_intent text not null,
  created_ms bigint not null,
  idempotency_key text,
  body text not null -- JSON as Stripe sends it
);
create index if not exists refunds_payment_intent_idx on stripe_emulator.refunds (payment_intent);
alter table stripe_emulator.payment_intents add column if not exists account text; -- Stripe-Account, null: the platform
alter table stripe_emulator.refunds add column if not exists account text;
alter table stripe_emulator.refunds add column if not exists reverse_transfer boolean not null default false;
alter table stripe_emulator.refunds add column if not exists refund_application_fee boolean not null default false;
create table if not exists stripe_emulator.events (
  seq bigserial primary key,
  id text not null unique,
  body text not null
);`;

export class PgState implements EmulatorState {
  private readonly pool: pg.Pool;
  /**
   * A session held for this state's life: a key it claimed stays `executing` while the session lives,
   * and is free again once its process died before committing (the charge and the key's result commit
   * together, so nothing was charged under it).
   */
  private readonly session: pg.Client;
  private readonly claimer: number;

  private constructor(pool: pg.Pool, session: pg.Client, claimer: number) {
    this.pool = pool;
    this.session = session;
    this.claimer = claimer;
  }

  /** Opens the state on `url`, creating its schema on first use. */
  static async open(url: string): Promise<PgState> {
    const pool = openPool(url, 'outboxd-stripe-emulator');
    const session = new pg.Client({ connectionString: url, application_name: 'outboxd-stripe-emulator' });
    session.on('error', () => {}); // a lost session only frees this process's executing keys
    try {
      await inTransaction(pool, async (tx) => {
        await tx.query('select pg_advisory_xact_lock($1)', [SCHEMA_LOCK]);
        await tx.query(DDL);
      });
      await session.connect();
      const { rows } = await session.query('select pg_backend_pid() as pid');
      return new PgState(pool, session, rows[0].pid);
    } catch (err) {
      await session.end().catch(() => {});
      await pool.end();
      throw err;
    }
  }

  async close(): Promise<void> {
    await this.session.end().catch(() => {});
    await this.pool.end();
  }

  private async settings() {
    return (await this.pool.query('select * from stripe_emulator.settings')).rows[0];
  }

  async clockOffsetMs(): Promise<number> {
    return (await this.settings()).clock_offset_ms;
  }

  async advanceClock(ms: number): Promise<void> {
    await this.pool.query('update stripe_emulator.settings set clock_offset_ms = clock_offset_ms + $1', [ms]);
  }

  async searchSettings(): Promise<SearchSettings> {
    const s = await this.settings();
    return { lagMs: s.search_lag_ms, frozenAtMs: s.search_frozen_at_ms };
  }

  async configureSearch(settings: Partial<SearchSettings>): Promise<void> {
    await this.pool.query(
      `update stripe_emulator.settings set search_lag_ms = coalesce($1, search_lag_ms),
         search_frozen_at_ms = case when $2 then $3::bigint else search_frozen_at_ms end`,
      [settings.lagMs ?? null, settings.frozenAtMs !== undefined, settings.frozenAtMs ?? null],
    );
  }

  async webhooks(): Promise<WebhookTarget | undefined> {
    return (await this.settings()).webhooks ?? undefined;
  }

  async configureWebhooks(target: WebhookTarget | undefined): Promise<void> {
    await this.pool.query('update stripe_emulator.settings set webhooks = $1', [target ? JSON.stringify(target) : null]);
  }

  async configureRateLimit(requestsPerSecond: number | null, accountRequestsPerSecond: number | null = null): Promise<void> {
    await inTransaction(this.pool, async (tx) => {
      await tx.query('delete from stripe_emulator.account_rates');
      await tx.query('update stripe_emulator.settings set rate_limit = $1::float8, account_rate_limit = $2::float8, rate_tokens = coalesce($1::float8, 0), rate_refilled_at = now()', [
        requestsPerSecond,
        accountRequestsPerSecond,
      ]);
    });
  }

  async revokeAccess(account: string, revoked: boolean): Promise<void> {
    await this.pool.query(
      `update stripe_emulator.settings set revoked_accounts = array_remove(revoked_accounts, $1) || case when $2 then array[$1] else '{}'::text[] end`,
      [account, revoked],
    );
  }

  async accessRevoked(account: string): Promise<boolean> {
    return (await this.pool.query('select $1 = any(revoked_accounts) as revoked from stripe_emulator.settings', [account])).rows[0].revoked;
  }

  /** The platform's bucket and the connected account's, refilled by the database clock: one limit for
   * every process serving this state. An account's bucket starts full, as the platform's did. */
  async admitRequest(account: string | null): Promise<boolean> {
    if (account !== null) {
      await this.pool.query(
        `insert into stripe_emulator.account_rates (account, tokens)
         select $1, coalesce(account_rate_limit, rate_limit) from stripe_emulator.settings where rate_limit is not null
         on conflict (account) do nothing`,
        [account],
      );
    }
    const { rows } = await this.pool.query(
      `with cur as (
         select least(rate_limit, rate_tokens + rate_limit * greatest(0, extract(epoch from now() - rate_refilled_at)::float8)) as avail,
           coalesce(account_rate_limit, rate_limit) as account_limit
         from stripe_emulator.settings where rate_limit is not null
         for update
       ), own as (
         select r.account, least(cur.account_limit, r.tokens + cur.account_limit * greatest(0, extract(epoch from now() - r.refilled_at)::float8)) as avail
         from stripe_emulator.account_rates r, cur where r.account = $1
         for update of r
       ), verdict as (
         select cur.avail >= 1 and coalesce((select avail >= 1 from own), true) as admitted from cur
       ), platform as (
         update stripe_emulator.settings s
         set rate_tokens = cur.avail - case when verdict.admitted then 1 else 0 end, rate_refilled_at = greatest(s.rate_refilled_at, now())
         from cur, verdict
         returning 1
       ), connected as (
         update stripe_emulator.account_rates r
         set tokens = own.avail - case when verdict.admitted then 1 else 0 end, refilled_at = greatest(r.refilled_at, now())
         from own, verdict where r.account = own.account
         returning 1
       )
       select admitted from verdict`,
      [account],
    );
    return rows[0]?.admitted ?? true;
  }

  async addFault(rule: FaultRule): Promise<string> {
    const { rows } = await this.pool.query(
      'insert into stripe_emulator.faults (endpoint, match, fault, remaining) values ($1, $2, $3, $4) returning seq',
      [endpointOf(rule), JSON.stringify(rule.match ?? {}), JSON.stringify(rule.fault), Number.isFinite(rule.count ?? 1) ? (rule.count ?? 1) : null],
    );
    return `rule_${rows[0].seq}`;
  }

  async clearFaults(): Promise<void> {
    await this.pool.query('delete from stripe_emulator.faults');
  }

  async takeFaults(endpoint: Endpoint, operationId: string | null, customer: string | null): Promise<Fault[]> {
    const live = 'remaining is null or remaining > 0';
    const { rows } = await this.pool.query(`select exists (select 1 from stripe_emulator.faults where ${live}) as any`);
    if (!rows[0].any) return [];
    // Rules are locked while one request takes its faults, so each use of a counted rule is one request's.
    return inTransaction(this.pool, async (tx) => {
      const found = (await tx.query(`select * from stripe_emulator.faults where ${live} order by seq for update`)).rows;
      const rules: ActiveRule[] = found.map((r) => ({ id: String(r.seq), endpoint: r.endpoint, match: r.match, fault: r.fault, count: r.remaining ?? Infinity }));
      const hit = pickFaults(rules, endpoint, operationId, customer);
      const counted = hit.filter((r) => Number.isFinite(r.count)).map((r) => Number(r.id));
      if (counted.length) await tx.query('update stripe_emulator.faults set remaining = remaining - 1 where seq = any($1)', [counted]);
      return hit.map((r) => r.fault);
    });
  }

  async claimKey(storeKey: string, paramsHash: string, nowMs: number, retentionMs: number): Promise<KeyClaim> {
    // Each turn either claims the key or reads what holds it; an expired or abandoned holder is removed
    // and the claim tried again. Three turns cover a race with another process doing the same.
    for (let turn = 0; turn < 3; turn++) {
      const claimed = await this.pool.query(
        `insert into stripe_emulator.idempotency_keys (store_key, state, params_hash, created_ms, claimer) values ($1, 'executing', $2, $3, $4)
         on conflict (store_key) do nothing`,
        [storeKey, paramsHash, nowMs, this.claimer],
      );
      if (claimed.rowCount === 1) return { kind: 'claimed' };
      const { rows } = await this.pool.query(
        `select k.*, not exists (select 1 from pg_stat_activity a where a.pid = k.claimer) as abandoned
         from stripe_emulator.idempotency_keys k where store_key = $1`,
        [storeKey],
      );
      const k = rows[0];
      if (!k) continue;
      if (k.state === 'done' && nowMs - k.created_ms >= retentionMs) {
        await this.pool.query(`delete from stripe_emulator.idempotency_keys where store_key = $1 and state = 'done' and created_ms = $2`, [storeKey, k.created_ms]);
        continue;
      }
      if (k.state === 'executing' && k.abandoned) {
        await this.pool.query(`delete from stripe_emulator.idempotency_keys where store_key = $1 and state = 'executing' and claimer = $2`, [storeKey, k.claimer]);
        continue;
      }
      if (k.params_hash !== paramsHash) return { kind: 'mismatch' };
      if (k.state === 'executing') return { kind: 'executing' };
      return { kind: 'done', response: { status: k.response_status, body: k.response_body } };
    }
    return { kind: 'executing' };
  }

  async releaseKey(storeKey: string): Promise<void> {
    await this.pool.query(`delete from stripe_emulator.idempotency_keys where store_key = $1 and state = 'executing'`, [storeKey]);
  }

  async commit(entry: LedgerEntry, key: { storeKey: string; response: StoredResponse } | null): Promise<void> {
    await inTransaction(this.pool, async (tx) => {
      await tx.query('insert into stripe_emulator.payment_intents (id, created_ms, idempotency_key, body, account) values ($1, $2, $3, $4, $5)', [
        entry.paymentIntent.id,
        entry.createdAtMs,
        entry.idempotencyKey,
        JSON.stringify(entry.paymentIntent),
        entry.account,
      ]);
      if (key) await storeResult(tx, key.storeKey, key.response);
    });
  }

  async pruneKeys(olderThanMs: number, nowMs: number): Promise<number> {
    const res = await this.pool.query(`delete from stripe_emulator.idempotency_keys where state = 'done' and $2 - created_ms >= $1`, [olderThanMs, nowMs]);
    return res.rowCount ?? 0;
  }

  async intent(id: string): Promise<LedgerEntry | undefined> {
    const { rows } = await this.pool.query('select * from stripe_emulator.payment_intents where id = $1', [id]);
    return rows[0] ? toEntry(rows[0]) : undefined;
  }

  async intents(): Promise<LedgerEntry[]> {
    return (await this.pool.query('select * from stripe_emulator.payment_intents order by seq')).rows.map(toEntry);
  }

  setStatus(id: string, status: string): Promise<PaymentIntent | undefined> {
    return this.changeBody<PaymentIntent>('payment_intents', id, (pi) => setIntentStatus(pi, status));
  }

  changeIntent(id: string, change: (pi: PaymentIntent) => IntentChange, storeKey: string | null): Promise<IntentChange | undefined> {
    // The PaymentIntent's row is the lock: a capture and a cancel of it are decided one after the other.
    return inTransaction(this.pool, async (tx) => {
      const { rows } = await tx.query('select body from stripe_emulator.payment_intents where id = $1 for update', [id]);
      if (!rows[0]) return undefined;
      const result = change(JSON.parse(rows[0].body));
      if ('refused' in result) return result;
      await tx.query('update stripe_emulator.payment_intents set body = $2 where id = $1', [id, JSON.stringify(result.paymentIntent)]);
      if (storeKey !== null) await storeResult(tx, storeKey, result.response);
      return result;
    });
  }

  /** One stored object's body, changed under its row's lock; undefined when there is no such object. */
  private changeBody<T>(table: 'payment_intents' | 'refunds', id: string, change: (body: T) => T): Promise<T | undefined> {
    return inTransaction(this.pool, async (tx) => {
      const { rows } = await tx.query(`select body from stripe_emulator.${table} where id = $1 for update`, [id]);
      if (!rows[0]) return undefined;
      const body = change(JSON.parse(rows[0].body));
      await tx.query(`update stripe_emulator.${table} set body = $2 where id = $1`, [id, JSON.stringify(body)]);
      return body;
    });
  }

  async commitRefund(entry: RefundEntry, key: { storeKey: string; response: StoredResponse } | null): Promise<{ committed: true } | { committed: false; remaining: number }> {
    const { refund } = entry;
    return inTransaction(this.pool, async (tx) => {
      // The PaymentIntent's row is the lock: two refunds of it are decided one after the other.
      const { rows } = await tx.query('select body from stripe_emulator.payment_intents where id = $1 for update', [refund.payment_intent]);
      const pi: PaymentIntent | undefined = rows[0] && JSON.parse(rows[0].body);
      const { rows: held } = await tx.query(
        `select coalesce(sum((body::jsonb->>'amount')::bigint), 0)::bigint as amount from stripe_emulator.refunds
         where payment_intent = $1 and body::jsonb->>'status' not in ('failed', 'canceled')`,
        [refund.payment_intent],
      );
      const remaining = (pi?.amount_received ?? 0) - Number(held[0].amount);
      if (!pi || pi.status !== 'succeeded' || refund.amount > remaining) return { committed: false, remaining: Math.max(remaining, 0) };
      await tx.query(
        `insert into stripe_emulator.refunds (id, payment_intent, created_ms, idempotency_key, body, account, reverse_transfer, refund_application_fee)
         values ($1, $2, $3, $4, $5, $6, $7, $8)`,
        [refund.id, refund.payment_intent, entry.createdAtMs, entry.idempotencyKey, JSON.stringify(refund), entry.account, entry.reverseTransfer, entry.refundApplicationFee],
      );
      if (key) await storeResult(tx, key.storeKey, key.response);
      return { committed: true };
    });
  }

  async refund(id: string): Promise<RefundEntry | undefined> {
    const { rows } = await this.pool.query('select * from stripe_emulator.refunds where id = $1', [id]);
    return rows[0] ? toRefundEntry(rows[0]) : undefined;
  }

  async refunds(): Promise<RefundEntry[]> {
    return (await this.pool.query('select * from stripe_emulator.refunds order by seq')).rows.map(toRefundEntry);
  }

  setRefundStatus(id: string, status: RefundStatus): Promise<Refund | undefined> {
    return this.changeBody<Refund>('refunds', id, (refund) => ({ ...refund, status }));
  }

  async addEvent(event: EmulatedEvent): Promise<void> {
    await this.pool.query('insert into stripe_emulator.events (id, body) values ($1, $2)', [event.id, JSON.stringify(event)]);
  }

  async events(): Promise<EmulatedEvent[]> {
    return (await this.pool.query('select body from stripe_emulator.events order by seq')).rows.map((r) => JSON.parse(r.body));
  }

  async event(id: string): Promise<EmulatedEvent | undefined> {
    const { rows } = await this.pool.query('select body from stripe_emulator.events where id = $1', [id]);
    return rows[0] ? JSON.parse(rows[0].body) : undefined;
  }

  async reset(): Promise<void> {
    await inTransaction(this.pool, async (tx) => {
      await tx.query('truncate stripe_emulator.faults, stripe_emulator.idempotency_keys, stripe_emulator.payment_intents, stripe_emulator.refunds, stripe_emulator.events, stripe_emulator.account_rates');
      await tx.query('update stripe_emulator.settings set clock_offset_ms = 0, search_lag_ms = 0, search_frozen_at_ms = null, webhooks = null, rate_limit = null, account_rate_limit = null, revoked_accounts = \'{}\'');
    });
  }
}

/** A key's first result, stored in the transaction that commits what it did. */
async function storeResult(tx: Tx, storeKey: string, response: StoredResponse): Promise<void> {
  await tx.query(
    `update stripe_emulator.idempotency_keys set state = 'done', claimer = null, response_status = $2, response_body = $3 where store_key = $1`,
    [storeKey, response.status, response.body],
  );
}

function toEntry(row: { body: string; idempotency_key: string | null; created_ms: number; account: string | null }): LedgerEntry {
  return { paymentIntent: JSON.parse(row.body), idempotencyKey: row.idempotency_key, createdAtMs: row.created_ms, account: row.account };
}

function toRefundEntry(row: { body: string; idempotency_key: string | null; created_ms: number; account: string | null; reverse_transfer: boolean; refund_application_fee: boolean }): RefundEntry {
  return {
    refund: JSON.parse(row.body),
    idempotencyKey: row.idempotency_key,
    createdAtMs: row.created_ms,
    account: row.account,
    reverseTransfer: row.reverse_transfer,
    refundApplicationFee: row.refund_application_fee,
  };
}
