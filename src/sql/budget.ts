// The statements of Stripe's rate limit as buckets shared by the fleet (src/stripe/budget.ts).
import type { SqlContext } from './context.ts';

export const budgetStatements = ({ s, statement }: SqlContext) => ({
  /** Each budget's bucket now, for the console: tokens left and how long since a dispatch call came up
   * short anywhere in the fleet (the budget was the bound then). The platform's buckets only: a
   * connected account's (`<budget>@acct_…`, src/stripe/budget.ts) are as many as the accounts. */
  rateBudgetStates: statement<[]>(
    'outboxd_rate_budget_states',
    `select name, tokens, extract(epoch from now() - short_at)::float8 as short_seconds_ago
     from ${s}.rate_budgets where strpos(name, '@') = 0 order by name`,
  ),

  /** A budget's bucket, empty: a first replica starts by waiting, not with a burst. */
  ensureRateBudget: statement<[name: string]>(
    'outboxd_ensure_rate_budget',
    `insert into ${s}.rate_budgets (name, tokens, refilled_at) values ($1, 0, now()) on conflict (name) do nothing`,
  ),

  /**
   * Refills the bucket by the database clock (rate $2/s, capacity $3) and grants up to $4 whole tokens,
   * under the row's lock: every replica's takes are serialised, so together they never get more than
   * rate × elapsed + capacity. The time is the clock's as the row is locked (clock_timestamp(), read again
   * if the take waited for the lock), not the transaction's start (now()), which a take that waited, or
   * whose transaction began a while before (a stalled process behind a pooler's begin), would have older
   * than the last take's. refilled_at only moves forward, so no interval is credited twice, unless it is
   * over a second ahead: the database clock stepped back (a failover to a standby whose clock lags), and
   * refilling from the clock (nothing for the step itself) keeps the bucket bounded without freezing it
   * until the clock catches up. $5: a background take, granted nothing while a dispatch take anywhere came
   * up short in the last $6 s; a dispatch take that comes up short records when. A short_at ahead of the
   * clock (written by a take whose clock ran ahead) yields until it passes, but while over a minute ahead
   * it is a clock that stepped back, not a shortage, and yields nothing. No row: the bucket does not exist
   * yet (ensureRateBudget).
   */
  takeRateBudget: statement<[name: string, rate: number, capacity: number, want: number, background: boolean, yieldSeconds: number]>(
    'outboxd_take_rate_budget',
    `with cur as (
       select name, tokens, refilled_at, short_at, clock_timestamp() as at
       from ${s}.rate_budgets where name = $1
       for update
     ), a as (
       select name, refilled_at, short_at, at,
         least($3::float8, tokens + $2::float8 * greatest(0, extract(epoch from at - refilled_at)::float8)) as avail,
         $5::boolean and coalesce(short_at > at - make_interval(secs => $6) and short_at < at + interval '1 minute', false) as yielded
       from cur
     ), g as (
       select a.*, case when yielded then 0 else greatest(0, least($4::int, floor(avail)::int)) end as granted from a
     )
     update ${s}.rate_budgets b
     set tokens = g.avail - g.granted,
         refilled_at = case when g.refilled_at > g.at + interval '1 second' then g.at else greatest(g.refilled_at, g.at) end,
         short_at = case when not $5::boolean and g.granted < $4::int then g.at else g.short_at end
     from g where b.name = g.name
     returning g.granted, (g.avail - g.granted)::float8 as remaining, g.yielded`,
  ),
});
