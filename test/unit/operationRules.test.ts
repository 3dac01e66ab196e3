// Rules read from an operation row alone: which PaymentIntent may settle a charge (its application fee),
// and the key an application reads back.
import { describe, expect, it } from 'vitest';
import { chargeMismatch } from '../../src/kinds/charge/evidence.ts';
import type { Charge } from '../../src/stripe/gateway.ts';
import { callerKeyOf, type Operation } from '../../src/types/operation.ts';

const ID = '01a24ec6-2d9c-7456-9fb6-c490b334e929';
const op = (over: Partial<Operation>): Operation =>
  ({ id: ID, kind: 'charge', status: 'pending', amount: 2599, currency: 'eur', external_id: null, payload: null, parent_operation_id: null, effect_key: null, ...over }) as Operation;
const pi = (over: Partial<Charge>): Charge => ({
  id: 'pi_1', status: 'succeeded', amount: 2599, currency: 'eur', operationId: ID, captureMethod: 'automatic', amountCapturable: 0, amountReceived: 2599,
  captureBefore: null, cancellationReason: null, account: 'acct_1Shop', ...over,
});

describe('a charge PaymentIntent’s application fee', () => {
  const direct = { stripe_account: 'acct_1Shop', application_fee_amount: 100 };
  it('must be the one a pending charge asked for: one the connected account made itself carries none', () => {
    expect(chargeMismatch(op({ payload: direct }), pi({ applicationFeeAmount: 100 }))).toBeNull();
    expect(chargeMismatch(op({ payload: direct }), pi({ applicationFeeAmount: null }))).toMatch(/application fee of none; the operation asked for 100/);
    expect(chargeMismatch(op({ payload: { stripe_account: 'acct_1Shop' } }), pi({ applicationFeeAmount: 100 }))).toMatch(/asked for none/);
  });
  it('none and 0 are one; a gateway that does not say is not asked', () => {
    expect(chargeMismatch(op({ payload: { stripe_account: 'acct_1Shop' } }), pi({ applicationFeeAmount: 0 }))).toBeNull();
    expect(chargeMismatch(op({ payload: { ...direct, application_fee_amount: 0 } }), pi({ applicationFeeAmount: null }))).toBeNull();
    expect(chargeMismatch(op({ payload: direct }), pi({}))).toBeNull();
  });
  it('is not asked of a settled charge’s own PaymentIntent, whose fee the platform may change since', () => {
    expect(chargeMismatch(op({ payload: direct, status: 'succeeded', external_id: 'pi_1' }), pi({ applicationFeeAmount: 250 }))).toBeNull();
  });
});

describe('callerKeyOf', () => {
  const charge = '01a24e99-cec1-7000-8000-000000000001';
  it("a capture's or cancel's key as its request gave it; any other operation's as stored", () => {
    expect(callerKeyOf(op({ kind: 'capture', parent_operation_id: charge, effect_key: `${charge}/ship`, payload: { key: 'ship' } }))).toBe('ship');
    expect(callerKeyOf(op({ kind: 'refund', parent_operation_id: charge, effect_key: 'r1', payload: { key: 'ignored' } }))).toBe('r1');
    expect(callerKeyOf(op({ kind: 'note', effect_key: 'null/x', payload: { key: 'x' } }))).toBe('null/x');
  });
});
