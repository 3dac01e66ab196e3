// Every kind of effect outboxd carries out, in one place, each with its policy on an outcome nobody
// knows (docs/architecture.md §8): which failure it tolerates when a call may or may not have acted.
//
//   kind     policy          on an ambiguous outcome                                   how it is done / checked
//   charge   idempotent-key  resend with the same key inside the window; past it,     src/payments/charge.ts
//                            reconcile (never create); zero or several → a person
//   refund   idempotent-key  the same, with refund-op:<id>; past the window the      src/payments/refund.ts
//                            PaymentIntent's refunds are listed and matched
//   (the application's own kinds, outboxd.defineEffect)                                 src/effects/application.ts
//            at-least-once   execute again; the possible duplicate is counted
//            reconcile-      the kind's check first: done → succeeded, not done →
//            before-retry    execute again, unknown → a person
//
// The executor (src/payments/executor.ts) is one protocol for every kind; what differs per kind is
// here: the policy, and the calls that carry the effect out and read what happened.
import type { PaymentGateway } from '../payments/gateway.ts';
import type { LoadedOperation, Outcome } from '../payments/operation.ts';
import { chargeCalls } from '../payments/charge.ts';
import { refundCalls } from '../payments/refund.ts';
import { applicationCalls, type EffectDefinition } from './application.ts';

import type { Policy } from '../payments/status.ts';

export type { Policy };

/**
 * The calls the executor makes for an operation:
 * - create: the one that may carry the effect out (a charge's create);
 * - retrieve: reads the provider's object already known for it (external_id);
 * - search: finds what the provider holds for it, past the key window or read-only (the sweep): Search
 *   for a charge, the PaymentIntent's list of refunds for a refund;
 * - check: establishes whether an earlier create that may have acted did (reconcile-before-retry).
 */
export type EffectCall = 'create' | 'retrieve' | 'search' | 'check';

/** What a call may use besides the operation. */
export interface CallContext {
  /** This call's number among the operation's calls (1 for the first). */
  attempt: number;
  /** Aborted when the claim is lost or the worker shuts down past its grace period. */
  signal: AbortSignal;
}

/** How one kind is carried out and checked: each call reports what it learned as an Outcome, or throws
 * (the executor classifies the error). */
export interface EffectCalls {
  create(op: LoadedOperation, ctx: CallContext): Promise<Outcome>;
  retrieve?(op: LoadedOperation, ctx: CallContext): Promise<Outcome>;
  search?(op: LoadedOperation, ctx: CallContext): Promise<Outcome>;
  check?(op: LoadedOperation, ctx: CallContext): Promise<Outcome>;
}

export interface Effect {
  kind: string;
  policy: Policy;
  calls: EffectCalls;
}

/** The built-in kinds: Stripe's, driven through the gateway. */
const BUILT_IN: Record<string, { policy: Policy; calls: (gateway: PaymentGateway) => EffectCalls }> = {
  charge: { policy: 'idempotent-key', calls: chargeCalls },
  refund: { policy: 'idempotent-key', calls: refundCalls },
};

export const BUILT_IN_KINDS: readonly string[] = Object.keys(BUILT_IN);

/** The kinds whose ambiguous outcomes the reconcile sweep settles through the provider (read-only). */
export const RECONCILED_KINDS: readonly string[] = BUILT_IN_KINDS.filter((k) => BUILT_IN[k]!.policy === 'idempotent-key');

/** The application's kinds this process defines (outboxd.defineEffect, `outboxd worker --effects`). */
export type EffectDefinitions = ReadonlyMap<string, EffectDefinition>;

/** The kind's definition, or undefined when this process does not know the kind. */
export function effectFor(kind: string, gateway: PaymentGateway, defined?: EffectDefinitions): Effect | undefined {
  const builtIn = BUILT_IN[kind];
  if (builtIn) return { kind, policy: builtIn.policy, calls: builtIn.calls(gateway) };
  const def = defined?.get(kind);
  return def && { kind, policy: def.policy, calls: applicationCalls(def) };
}
