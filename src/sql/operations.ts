// The statements of the operation's state machine (src/engine/operation.ts), its only writer of status: the load, the
// lease and fence (docs/architecture.md §3), the executor's fenced writes, and settlement from outside
// the executor (a person's resolution, a Stripe webhook).
import { CALL_FACT_WEIGHT as W, DISCREPANCY_MAX, DISCREPANCY_MORE, DISCREPANCY_PREFIX, DISCREPANCY_SEPARATOR as SEP } from '../types/contracts.ts';
import type { SqlContext } from './context.ts';

export const operationsStatements = ({ UNSETTLED, byIds, event, operationColumns, s, settlementEvent, statement, unsettledRow }: SqlContext) => {
  /** Whether a review reason is one an operation keeps whatever happens to it but a person's word: a
   * discrepancy with Stripe (DISCREPANCY_PREFIX). */
  const isDiscrepancy = (reason: string) => `starts_with(${reason}, '${DISCREPANCY_PREFIX}')`;
  /** The review reason if it is a discrepancy, or null. */
  const discrepancy = (reason: string) => `case when ${isDiscrepancy(reason)} then ${reason} end`;
  /** A discrepancy's `reason` with `given` listed in it (whole, once; past DISCREPANCY_MAX it says the
   * timeline has more): what a person reads before answering it is all there. `given`, a discrepancy
   * itself (several charges found, again at each search), is listed without its prefix; the reason
   * itself (the dead-letter handler flags with the one it read) adds nothing. */
  const listedIn = (reason: string, given: string) => {
    const item = `case when ${isDiscrepancy(given)} then substr(${given}, ${DISCREPANCY_PREFIX.length + 1}) else ${given} end`;
    return `case
         when ${given} = ${reason}
           or ${item} = any(string_to_array(substr(${reason}, ${DISCREPANCY_PREFIX.length + 1}), '${SEP}'))
           or right(${reason}, ${DISCREPANCY_MORE.length}) = '${DISCREPANCY_MORE}' then ${reason}
         when length(${reason}) > ${DISCREPANCY_MAX} then ${reason} || '${DISCREPANCY_MORE}'
         else ${reason} || '${SEP}' || ${item} end`;
  };
  /** review_reason with `given` added: `given` when none is held, listed in a discrepancy (listedIn),
   * else before the reason held, which is kept so that none is cleared unseen. */
  const withReason = (given: string) => `case
         when review_reason is null then ${given}
         when ${isDiscrepancy('review_reason')} then ${listedIn('review_reason', given)}
         else ${given} || '${SEP}' || review_reason end`;
  /** recordOutcomes' ids, for byIds. */
  const OUTCOME_IDS = 'array(select id from input)';
  /** A claim's timeline row: the fence, the owner, and of a takeover the owner whose expired lease it took
   * and `unanswered`: how many of the calls counted before this claim (`attempts`) neither an outcome
   * answers nor an earlier takeover counted: calls its previous owner made and never recorded (it died,
   * or stalled past its lease), which may have reached Stripe. */
  const claimEvent = (from: string, attempts: string) =>
    event(from, `id, 'claimed', fence, lease_owner, jsonb_strip_nulls(jsonb_build_object('previous_owner', previous_owner,
      'unanswered', case when previous_owner is not null then ${attempts} - (
        select coalesce(sum(case when e.type = 'outcome' then e.repeats else coalesce((e.details->>'unanswered')::int, 0) end), 0)
        from ${s}.operation_events e where e.operation_id = ${from}.id and e.type in ('outcome', 'claimed')) end))`);
  /** recordOutcomes, its rows locked first in id order, as the update would lock them (`no key update`:
   * a foreign key's check on the row does not hold it): `skip locked` leaves a row another transaction
   * holds (an application's `select … for update`) unwritten, answered `held`, rather than wait for it
   * with every outcome of the batch, and every batch behind it. */
  const recordOutcomesSql = (lock: 'skip locked' | '') =>
    `with input as (
       select * from jsonb_to_recordset($1::jsonb) as x(
         ord int, id uuid, fence bigint, status text, external_id text, last_outcome text, last_error text,
         review_reason text, undo boolean, first_attempted_at timestamptz, last_attempted_at timestamptz,
         source text, event jsonb, result text, recheck_seconds int, owner text)
     ), target as (
       select o.id from ${s}.payment_operations o where ${byIds('o', OUTCOME_IDS)} order by o.id for no key update of o ${lock}
     ), op as (
     update ${s}.payment_operations o
     set status = x.status, external_id = coalesce(x.external_id, o.external_id), last_outcome = x.last_outcome,
         last_error = x.last_error,
         -- a review reason stays until the operation settles (a later ambiguous retry does not clear it),
         -- a discrepancy after it too, with any other reason listed in it
         review_reason = case
           when ${isDiscrepancy('o.review_reason')} then
             case when x.review_reason is null then o.review_reason else ${listedIn('o.review_reason', 'x.review_reason')} end
           when x.status in ('succeeded', 'failed') then null
           else coalesce(x.review_reason, o.review_reason) end,
         first_attempted_at = case when x.undo then x.first_attempted_at else o.first_attempted_at end,
         last_attempted_at = case when x.undo then x.last_attempted_at else o.last_attempted_at end,
         result = coalesce(x.result::jsonb, o.result),
         processing_since = case when x.last_outcome = 'processing' then coalesce(o.processing_since, now()) else o.processing_since end,
         next_check_at = now() + make_interval(secs => x.recheck_seconds),
         updated_at = now(), lease_owner = null, lease_expires_at = null,
         settled_at = case when x.status in ('succeeded', 'failed') then now() end
     from input x
     where o.id = x.id and o.id in (select id from target) and o.fence = x.fence and ${unsettledRow('o')} and ${byIds('o', OUTCOME_IDS)}
     returning ${operationColumns('o')}, x.ord, x.source, x.event, x.owner as call_owner
     ), settled_event as (
       insert into ${s}.settlement_outbox (operation_id, source)
       select id, source from op where status in ('succeeded', 'failed') order by ord
     ), ${event('op', `id, 'outcome', fence, call_owner, event`)}
     select ${operationColumns('op')}, op.ord, op.source, op.event, cur.fence as current_fence, cur.status as current_status,
       cur.id is not null and target.id is null as held
     from input
     left join op on op.ord = input.ord
     left join ${s}.payment_operations cur on cur.id = input.id and ${byIds('cur', OUTCOME_IDS)}
     left join target on target.id = input.id
     order by input.ord`;
  return {
  /** The operation, with whether its idempotency key window (seconds from first_attempted_at) has passed,
   * judged by the database clock so that every replica agrees. */
  loadOperation: statement<[id: string, keyWindowSeconds: number]>(
    'outboxd_load_operation',
    `select ${operationColumns()}, coalesce(first_attempted_at < now() - make_interval(secs => $2), false) as key_window_passed
     from ${s}.payment_operations where id = $1`,
  ),

  /** Takes the lease if it is free or expired; every claim gets a strictly larger fencing token. A row
   * another transaction holds (an application's `select … for update`) is skipped, not waited for: no row.
   * Returns the claimed operation as loadOperation does (the executor needs no second read), and
   * previous_owner when an expired lease was taken over (its holder died or stalled). The timeline
   * records the claim in the same statement. */
  acquireLease: statement<[id: string, owner: string, ttlMs: number, keyWindowSeconds: number]>(
    'outboxd_acquire_lease',
    `with prev as (select id, lease_owner, attempts from ${s}.payment_operations where id = $1 for update skip locked), claimed as (
     update ${s}.payment_operations op
     set fence = op.fence + 1, lease_owner = $2, lease_expires_at = now() + make_interval(secs => $3 / 1000.0),
         updated_at = now()
     from prev
     where op.id = prev.id and op.${UNSETTLED} and (op.lease_expires_at is null or op.lease_expires_at < now())
     returning ${operationColumns('op')}, prev.lease_owner as previous_owner, prev.attempts as prev_attempts,
       coalesce(op.first_attempted_at < now() - make_interval(secs => $4), false) as key_window_passed
     ), ${claimEvent('claimed', 'prev_attempts')}
     select ${operationColumns()}, previous_owner, key_window_passed from claimed`,
  ),

  /**
   * The dispatcher's claims, each with the attempt of the call it leads to, many operations in ONE
   * statement: each a claim as acquireLease makes, that also counts the call the kind's policy chooses
   * for what the row holds, and stamps it as recordAttempt does (a create: first_attempted_at once,
   * last_attempted_at now, the stamps before returned for an undo; an at-least-once create after one that
   * may have acted counted as a possible duplicate). $7: the policy's call for each combination of the
   * row's facts, indexed as src/types/contracts.ts says (CALL_FACT_WEIGHT), for
   * kind $5 under policy $6; a row of another kind or requested under another policy is claimed without
   * an attempt (call null), and the executor chooses and counts, or holds it for a person, as for any
   * claim. A row another transaction holds (an application's `select … for update`) is skipped, not
   * waited for, and an id asked twice is claimed for its first request only. The timeline records a claim
   * only when it takes over an expired lease (what the lost owner left unanswered with it); the call is
   * recorded with its outcome (recordOutcomes), one row per call. One row per request, in order: `id` is null when nothing was claimed for it
   * (settled, leased by a live claim, locked: `locked`, or no such operation), and current_* say what the
   * row holds (read without its lock when another transaction holds it).
   */
  claimAttempts: statement<
    [ids: readonly string[], owner: string, ttlMs: number, keyWindowSeconds: number, kind: string, policy: string, calls: readonly string[]]
  >(
    'outboxd_claim_attempts',
    `with req as (
       select r.id, r.ord, row_number() over (partition by r.id order by r.ord) = 1 as first
       from unnest($1::uuid[]) with ordinality r(id, ord)
     ), prev as (
       select op.id, op.kind, op.status, op.lease_owner, op.first_attempted_at, op.last_attempted_at,
         w.passed as key_window_passed,
         case when op.kind = $5 and op.policy = $6 then
           ($7::text[])[1 + ${W.externalIdKnown} * (op.external_id is not null)::int + ${W.keyWindowPassed} * w.passed::int + ${W.attemptedBefore} * (op.first_attempted_at is not null)::int]
         end as call
       from ${s}.payment_operations op
       cross join lateral (select coalesce(op.first_attempted_at < now() - make_interval(secs => $4), false) as passed) w
       where op.id = any($1::uuid[])
       order by op.id
       for update of op skip locked
     ), claimed as (
       update ${s}.payment_operations op
       set fence = op.fence + 1, lease_owner = $2, lease_expires_at = now() + make_interval(secs => $3 / 1000.0),
           updated_at = now(),
           attempts = op.attempts + (prev.call is not null)::int,
           first_attempted_at = case when prev.call = 'create' then coalesce(op.first_attempted_at, now()) else op.first_attempted_at end,
           last_attempted_at = case when prev.call = 'create' then now() else op.last_attempted_at end,
           possible_duplicates = op.possible_duplicates
             + coalesce(prev.call = 'create' and $6 = 'at-least-once' and op.first_attempted_at is not null, false)::int
       from prev
       where op.id = prev.id and ${byIds('op', '$1::uuid[]')} and ${unsettledRow('op')}
         and (op.lease_expires_at is null or op.lease_expires_at < now())
       returning ${operationColumns('op')}, prev.lease_owner as previous_owner, prev.key_window_passed, prev.call,
         prev.first_attempted_at as prev_first_attempted_at, prev.last_attempted_at as prev_last_attempted_at
     ), takeovers as (
       select * from claimed where previous_owner is not null order by id
     ), ${claimEvent('takeovers', 'attempts - (call is not null)::int')}
     select mine.*, coalesce(prev.status, cur.status) as current_status,
       coalesce(won.lease_owner, prev.lease_owner, cur.lease_owner) as current_owner, prev.id is null and cur.id is not null as locked
     from req
     left join ${s}.payment_operations cur on cur.id = req.id and ${byIds('cur', '$1::uuid[]')}
     left join prev on prev.id = req.id
     left join claimed won on won.id = req.id
     left join claimed mine on mine.id = req.id and req.first
     order by req.ord`,
  ),

  renewLease: statement<[id: string, fence: number, ttlMs: number]>(
    'outboxd_renew_lease',
    `update ${s}.payment_operations set lease_expires_at = now() + make_interval(secs => $3 / 1000.0)
     where id = $1 and fence = $2 and lease_owner is not null
     returning lease_expires_at`,
  ),

  releaseLease: statement<[id: string, fence: number]>(
    'outboxd_release_lease',
    `update ${s}.payment_operations set lease_owner = null, lease_expires_at = null
     where id = $1 and fence = $2 and lease_owner is not null`,
  ),

  /**
   * Fenced, the lease kept: a reconcile-before-retry create given up (past its timeout, or at a drain)
   * may still act, so its operation is held for a person with reason $3 until the call is known to have
   * returned (clearCreateMayStillAct); a claim that finds it after the lease lapsed trusts no check that
   * finds nothing done (src/engine/executor.ts). A reason held already is kept beside it (withReason),
   * and the mark is set once.
   */
  markCreateMayStillAct: statement<[id: string, fence: number, reason: string]>(
    'outboxd_mark_create_may_still_act',
    `with marked as (
     update ${s}.payment_operations
     set review_reason = case when strpos(review_reason, $3) > 0 then review_reason else ${withReason('$3')} end,
       updated_at = now()
     where id = $1 and fence = $2 and lease_owner is not null and ${UNSETTLED}
     returning id
     ), ${event('marked', `id, 'flagged', $2, null, jsonb_build_object('reason', $3::text)`)}
     select id from marked`,
  ),

  /** Fenced: the create markCreateMayStillAct marked returned; its reason goes (one another reason joined
   * stays for a person): the next claim's check can be trusted. */
  clearCreateMayStillAct: statement<[id: string, fence: number, reason: string]>(
    'outboxd_clear_create_may_still_act',
    `update ${s}.payment_operations set review_reason = null, updated_at = now()
     where id = $1 and fence = $2 and review_reason = $3`,
  ),

  /** Gives a claim back that sent nothing (one claimed ahead of a free slot that got none: the replica
   * began to drain, the wait ran out, or the claim's lease deadline passed): its lease ends, and the attempt it counted is uncounted, with the stamps it replaced ($3: the call it
   * counted, or null; $4, $5: first_attempted_at and last_attempted_at before it; $6: 1 when it counted
   * a possible duplicate), so no key window is opened by a create that was never sent. Fenced: after a
   * settlement from outside or another claim (the fence moved) nothing is changed; a lease the drain's
   * releaseLeasesOf ended first is still this claim's to uncount. */
  releaseUnsentClaim: statement<[id: string, fence: number, call: string | null, prevFirst: Date | null, prevLast: Date | null, duplicate: number]>(
    'outboxd_release_unsent_claim',
    `update ${s}.payment_operations
     set lease_owner = null, lease_expires_at = null, updated_at = now(),
         attempts = attempts - ($3::text is not null)::int,
         first_attempted_at = case when $3::text = 'create' then $4::timestamptz else first_attempted_at end,
         last_attempted_at = case when $3::text = 'create' then $5::timestamptz else last_attempted_at end,
         possible_duplicates = possible_duplicates - $6::int
     where id = $1 and fence = $2`,
  ),

  /** At shutdown: gives back every lease this replica still holds but those of calls still in flight
   * ($2), so others need not wait for expiry. */
  releaseLeasesOf: statement<[owner: string, inFlight: readonly string[]]>(
    'outboxd_release_leases_of',
    `update ${s}.payment_operations set lease_owner = null, lease_expires_at = null
     where lease_owner = $1 and id <> all($2::uuid[])
     returning id`,
  ),

  /** Counts a call before it is made; for a create, records first_attempted_at (the first send,
   * invariant 7) and last_attempted_at before the send, returning what they were, so that an outcome that
   * proves nothing executed can put them back. $4: an at-least-once kind, whose create after one that
   * may have acted (first_attempted_at already set) is counted as a possible duplicate. Zero rows: the
   * fence moved or the operation settled, and the call must not be made. The call joins the timeline
   * with its outcome; one whose outcome never follows is counted here (attempts), and the claim that
   * takes its lease over says so. */
  recordAttempt: statement<[id: string, fence: number, call: string, atLeastOnce: boolean]>(
    'outboxd_record_attempt',
    `with prev as (select first_attempted_at, last_attempted_at from ${s}.payment_operations where id = $1)
     update ${s}.payment_operations
     set attempts = attempts + 1, updated_at = now(),
         first_attempted_at = case when $3 = 'create' then coalesce(first_attempted_at, now()) else first_attempted_at end,
         last_attempted_at = case when $3 = 'create' then now() else last_attempted_at end,
         possible_duplicates = possible_duplicates + case when $3 = 'create' and $4 and first_attempted_at is not null then 1 else 0 end
     where id = $1 and fence = $2 and ${UNSETTLED}
     returning attempts, first_attempted_at,
       (select first_attempted_at from prev) as prev_first_attempted_at,
       (select last_attempted_at from prev) as prev_last_attempted_at`,
  ),

  /** Writes outcomes, each ending its claim's lease, many operations in ONE statement ($1: a JSON array,
   * one object per outcome with the fields below). Never touches a settled operation (invariant 5) and
   * only with the claim's current fence (invariant 8). settled_at is set exactly when the new status is
   * settled, and then, in the same statement, its settlement event (`source`: what settled it). `undo`:
   * the call provably executed nothing (a 429, 401/403, a connection never opened), so the attempt stamps
   * go back to first_attempted_at/last_attempted_at: a window that only such calls opened is not open (or
   * a check found that no earlier execution happened: first_attempted_at goes back to null, and
   * last_attempted_at stays the last send's). `event`: what the timeline
   * keeps of the call (its outcome, duration, Stripe's request id), written by the same statement.
   * `result`: an application effect's (JSON). A `processing` outcome stamps processing_since once (when
   * it first waited); `recheck_seconds` sets next_check_at (every other outcome clears it). One row per outcome, in order: `id` is null when the fence
   * moved or the operation had settled, or, `held`, when another transaction holds its row; current_* say
   * what it holds. */
  recordOutcomes: statement<[outcomes: string]>('outboxd_record_outcomes', recordOutcomesSql('skip locked')),

  /** recordOutcomes of an outcome whose row another transaction held: waits for it (up to lock_timeout). */
  recordOutcomesWaiting: statement<[outcomes: string]>('outboxd_record_outcomes_waiting', recordOutcomesSql('')),

  /** Fenced: holds an unsettled operation for a person without changing its status; ends the claim. */
  flagForReview: statement<[id: string, fence: number, reason: string]>(
    'outboxd_flag_for_review',
    `with flagged as (
     update ${s}.payment_operations
     set review_reason = case when ${isDiscrepancy('review_reason')} then ${listedIn('review_reason', '$3::text')} else $3 end,
         updated_at = now(), lease_owner = null, lease_expires_at = null
     where id = $1 and fence = $2 and ${UNSETTLED}
     returning ${operationColumns()}
     ), ${event('flagged', `id, 'flagged', $2, null, jsonb_build_object('reason', $3::text)`)}
     select * from flagged`,
  ),

  fenceOf: statement<[id: string]>(
    'outboxd_fence_of',
    `select fence, status, lease_owner from ${s}.payment_operations where id = $1`,
  ),

  /** Another operation of the kind that records the object as its own (payment_operations_external_idx). */
  externalIdOwner: statement<[externalId: string, kind: string, id: string]>(
    'outboxd_external_id_owner',
    `select id from ${s}.payment_operations where external_id = $1 and kind = $2 and id <> $3 limit 1`,
  ),

  /** Settles an unsettled operation and bumps the fence, so a worker still holding a claim is fenced out;
   * its settlement event ($6: what settled it) in the same statement; $7: what the kind keeps of the object.
   * A discrepancy stays for a person. */
  settleFromOutside: statement<
    [id: string, status: 'succeeded' | 'failed', externalId: string | null, lastOutcome: string, lastError: string | null, source: string, result: string | null]
  >(
    'outboxd_settle_from_outside',
    `with op as (
     update ${s}.payment_operations
     set fence = fence + 1, lease_owner = null, lease_expires_at = null,
         status = $2, external_id = coalesce($3, external_id), last_outcome = $4, last_error = $5,
         result = coalesce($7::jsonb, result),
         review_reason = ${discrepancy('review_reason')}, next_check_at = null, settled_at = now(), updated_at = now()
     where id = $1 and ${UNSETTLED}
     returning ${operationColumns()}
     ), ${settlementEvent('$6')},
     ${event('op', `id, 'settled', fence, last_outcome, jsonb_strip_nulls(jsonb_build_object('status', status, 'external_id', external_id, 'reason', last_error))`)}
     select * from op`,
  ),

  /** A person's resolution, written under the lease the resolution holds: fenced like any claim, so it
   * cannot land after another claim took the operation over; its settlement event in the same statement.
   * It answers the review reason it claimed the operation with ($8), a discrepancy too (the person saw
   * it); a discrepancy flagged while it checked the evidence stays. */
  settleUnderLease: statement<
    [
      id: string, fence: number, status: 'succeeded' | 'failed', externalId: string | null, lastOutcome: string, lastError: string | null,
      result: string | null, reasonAtClaim: string | null,
    ]
  >(
    'outboxd_settle_under_lease',
    `with op as (
     update ${s}.payment_operations
     set lease_owner = null, lease_expires_at = null,
         status = $3, external_id = coalesce($4, external_id), last_outcome = $5, last_error = $6,
         result = coalesce($7::jsonb, result),
         review_reason = case when review_reason is not distinct from $8 then null else ${discrepancy('review_reason')} end,
         next_check_at = null, settled_at = now(), updated_at = now()
     where id = $1 and fence = $2 and ${UNSETTLED}
     returning ${operationColumns()}
     ), ${settlementEvent("'admin'")},
     ${event('op', `id, 'settled', fence, last_outcome, jsonb_strip_nulls(jsonb_build_object('status', status, 'external_id', external_id, 'reason', last_error))`)}
     select * from op`,
  ),

  /** Holds an operation, settled or not, for a person from outside any claim: a discrepancy with Stripe
   * (DISCREPANCY_PREFIX, a webhook's object that is not the operation's or contradicts its settlement).
   * Neither the status nor anything it settled to is touched, so no fence is needed; the reason stays
   * until a person resolves or acknowledges it. A discrepancy already there is added to (listedIn), and a
   * reason the operation was held for before is kept after it, so that none is cleared unseen. */
  flagDiscrepancy: statement<[id: string, reason: string]>(
    'outboxd_flag_discrepancy',
    `with flagged as (
     update ${s}.payment_operations set review_reason = ${withReason('$2')},
       updated_at = now()
     where id = $1
     returning id
     ), ${event('flagged', `id, 'flagged', null, null, jsonb_build_object('reason', $2::text)`)}
     select id from flagged`,
  ),

  /** A person's acknowledgement of a settled operation's review reason (a discrepancy they dealt with in
   * Stripe: a second charge refunded, say), while it is still $4, the one they read (one added since is
   * not cleared unseen): the reason goes; nothing else changes. */
  acknowledgeReview: statement<[id: string, actor: string, note: string, reasonSeen: string]>(
    'outboxd_acknowledge_review',
    `with prev as (
       select id, review_reason from ${s}.payment_operations
       where id = $1 and status in ('succeeded', 'failed') and review_reason = $4
       for no key update
     ), acked as (
     update ${s}.payment_operations o set review_reason = null, updated_at = now()
     from prev where o.id = prev.id
     returning ${operationColumns('o')}, prev.review_reason as acknowledged_reason
     ), ${event('acked', `id, 'acknowledged', null, $2::text, jsonb_build_object('note', $3::text, 'reason', acknowledged_reason)`)}
     select * from acked`,
  ),
};
};
